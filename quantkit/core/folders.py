"""Hugging Face safetensors folder conventions shared by the source reader and the checkpoint writer."""
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from quantkit.core.errors import QuantkitError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def drop_shared(tensors: dict) -> dict:
    """Keep one name per storage (tied embeddings): safetensors refuses shared tensors."""
    seen, kept = set(), {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.device.type != "meta" else name
        if key in seen:
            continue
        seen.add(key)
        kept[name] = t
    return kept


def index_map(folder: Path, fix: str) -> dict:
    """{tensor: shard file} from a folder's model.safetensors.index.json, checked against the shards' own
    headers (no tensor data is read): the index is a JSON weight_map of tensor names to file names in the
    folder, every file it names exists and opens, each tensor is in the file the index names, and no shard
    holds a tensor the index does not list (a reader would silently miss it). Every problem is a
    QuantkitError naming the tensor and the files; `fix` says what to do."""
    index = folder / INDEX_NAME
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise QuantkitError(f"{index} is damaged ({type(e).__name__}: {e}): {fix}") from e
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise QuantkitError(f"{index}: weight_map must map tensor names to shard file names: {fix}")
    files = sorted(set(weight_map.values()))
    for f in files:
        if Path(f).name != f or not f.endswith(".safetensors"):
            raise QuantkitError(f"{index} names {f!r}, not a .safetensors file in {folder}: {fix}")
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        first = next(n for n, f in weight_map.items() if f == missing[0])
        raise QuantkitError(f"{index} puts {first} (and more) in {missing[0]}, which is missing"
                            f"{f' (as are {len(missing) - 1} more shards)' if len(missing) > 1 else ''}: {fix}")
    held = {}
    for f in files:
        try:
            with safe_open(folder / f, framework="pt") as sf:
                for name in sf.keys():
                    held.setdefault(name, []).append(f)
        except (SafetensorError, OSError) as e:
            raise QuantkitError(f"{folder / f} is truncated or corrupted ({e}): {fix}") from e
    for name, f in weight_map.items():
        if name not in held:
            raise QuantkitError(f"{index} puts tensor {name} in {f}, but no shard holds it: {fix}")
        if f not in held[name]:
            raise QuantkitError(f"{index} puts tensor {name} in {f}, but it is in {held[name][0]}: {fix}")
    for name, where in held.items():
        if len(where) > 1:
            raise QuantkitError(f"tensor {name} is in both {where[0]} and {where[1]} of {folder}: {fix}")
        if name not in weight_map:
            raise QuantkitError(f"{folder / where[0]} holds tensor {name}, which {INDEX_NAME} does not list: {fix}")
    return weight_map


def shard_map(folder: Path) -> dict | None:
    """{tensor name: shard file} of a safetensors folder, None when it has no safetensors."""
    fix = "download or copy the model again"
    if (folder / INDEX_NAME).is_file():
        return index_map(folder, fix)
    shards = sorted(folder.glob("*.safetensors"))
    if not (folder / SINGLE_NAME).is_file() and len(shards) > 1:
        raise QuantkitError(f"model '{folder}' has {len(shards)} safetensors shards ({shards[0].name}, ...) but no "
                            f"{INDEX_NAME}, which says which tensor is where: {fix}")
    if (folder / SINGLE_NAME).is_file():
        try:
            with safe_open(folder / SINGLE_NAME, framework="pt") as f:
                return {k: SINGLE_NAME for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise QuantkitError(f"a safetensors file of model '{folder}' is truncated or corrupted ({e}): "
                                "download or copy the model again") from e
    return None


def file_state(path: Path) -> tuple | None:
    """(size, modification time, inode) of a file, None if it is gone: a file replaced while being read differs."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino
