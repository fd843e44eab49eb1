"""The fp source model without holding it: a meta-device skeleton whose tensors come from the safetensors shards.

StreamedModel.load(prefix) reads the tensors under a module path (a decoder block) straight from the shards,
casting them to the compute dtype; release(prefix) turns them back into meta tensors. Each read opens the
shard with safe_open and closes it again: a memory-mapped file whose pages were touched counts in the
process's resident memory for as long as it stays mapped, so keeping every shard open would grow RSS to the
model's size. Modules outside the decoder blocks (embeddings, rotary, final norm, lm_head) load themselves on
their first forward call (a pre-hook): capturing block 0's inputs touches only what runs before block 0.

Sources that cannot be streamed (no safetensors, tensors transformers fuses or converts as it loads, hub ids)
fall back to loading the whole model (quantkit.models.hub) behind the same interface: the old memory, the same
result.
"""
import re
import sys
from pathlib import Path

import torch
from torch import nn

from quantkit.core.errors import QuantkitError
from quantkit.core.finite import all_finite
from quantkit.core.folders import drop_shared, file_state, shard_map
from quantkit.models import hub as loader
from quantkit.models.moe import split_experts
from quantkit.models.names import FileNames
from quantkit.models.sliced import split_sliced


class StreamedModel:
    """model: the skeleton (parameters on meta); names: checkpoint tensor names in state-dict order, tied
    duplicates dropped (safetensors refuses shared storage, quantkit.core.folders.drop_shared)."""

    def __init__(self, folder: Path, config, compute_dtype, files: dict, source_name: str, trust_remote_code=False,
                 fp8_block=None):
        from accelerate import init_empty_weights
        self.folder, self.files, self.source_name, self.dtype = folder, files, source_name, compute_dtype
        self.fp8_block = fp8_block  # (rows, cols): FP8 weights with a weight_scale_inv per block, dequantized on read
        with init_empty_weights(include_buffers=False):
            self.model = loader.model_class(config).from_config(config, dtype=compute_dtype,
                                                                trust_remote_code=trust_remote_code)
        self.model.tie_weights()
        split_experts(self.model)  # names per expert, as the original MoE checkpoints store them
        self.model.eval()
        if (folder / "generation_config.json").is_file():  # what from_pretrained would have read
            from transformers import GenerationConfig

            self.model.generation_config = GenerationConfig.from_pretrained(folder)
        self.names = _distinct_state_names(self.model)
        # each tensor's name in the files: its own, or the one transformers saves (Mixtral's block_sparse_moe.w1)
        in_files = FileNames(self.model)
        self.stored = {n: n if n in files else in_files.of_tensor(n) for n in self.names}
        self.files = {n: files[s] for n, s in self.stored.items() if s in files}
        self.unloaded = unloaded_tensors(files, set(self.stored.values()), fp8_block is not None)
        self.files.update({n: files[n] for n in self.unloaded})
        self.seen = {f: file_state(folder / f) for f in set(self.files.values())}  # checked at every read

    def read(self, names, dtype=None) -> dict:
        """{name: tensor} from the shards (one open per shard, closed again), checked finite."""
        from safetensors import SafetensorError, safe_open

        by_file, out = {}, {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        for fname, group in by_file.items():
            self._check_unchanged(fname)
            try:
                with safe_open(self.folder / fname, framework="pt") as f:
                    for n in group:
                        out[n] = self._stored(f, n)
            except (SafetensorError, OSError) as e:
                raise QuantkitError(f"a safetensors file of model '{self.source_name}' is truncated or corrupted "
                                    f"({fname}: {e}): download or copy the model again") from e
        for n, t in out.items():
            if t.is_floating_point() and not all_finite(t):
                bad = int((~torch.isfinite(t)).sum())
                raise QuantkitError(f"model '{self.source_name}': tensor {n} has {bad} NaN/Inf value(s) of {t.numel()}: "
                                    "the weights are damaged (or overflowed when cast to a half type: try --dtype "
                                    "float32); fix the model first")
            if dtype is not None and t.is_floating_point():
                out[n] = t.to(dtype)
        return out

    def _check_unchanged(self, fname: str) -> None:
        """The shard is the one the run started with: a source replaced during a run (a download or copy still
        going on) would give a checkpoint whose first blocks come from one model and the rest from another."""
        if file_state(self.folder / fname) != self.seen[fname]:
            raise QuantkitError(f"model '{self.source_name}': {fname} changed while this run was reading it (its size "
                                "or modification time): the result would mix two models; let whatever writes the "
                                "model finish, then run again")

    def read_unloaded(self, names) -> dict:
        """{name: tensor} of tensors the model does not load (quantkit.models.stream.unloaded_tensors), as stored."""
        from safetensors import safe_open

        out = {}
        for n in names:
            self._check_unchanged(self.files[n])
            with safe_open(self.folder / self.files[n], framework="pt") as f:
                out[n] = f.get_tensor(n)
        return out

    def split_sliced(self, params) -> None:
        """Split these 3-D parameters into one linear per expert (quantkit.models.sliced): expert e's weight is read
        as slice e of the stored tensor."""
        for param, experts in split_sliced(self.model, params).items():
            at = self.names.index(param)
            self.names[at:at + 1] = experts
            stored, shard = self.stored.pop(param), self.files.pop(param)
            for e, name in enumerate(experts):
                self.stored[name], self.files[name] = (stored, e), shard

    def _stored(self, f, name: str) -> torch.Tensor:
        """Tensor `name` of the open shard f, an FP8 weight dequantized by its block scales; an expert's slice of a
        3-D tensor (split_sliced) read alone."""
        stored = self.stored[name]
        if not isinstance(stored, tuple):
            return self._whole(f, stored)
        whole, expert = stored  # an FP8 tensor is dequantized whole: its block scales span the experts
        return f.get_slice(whole)[expert] if self.fp8_block is None else self._whole(f, whole)[expert]

    def _whole(self, f, name: str) -> torch.Tensor:
        t = f.get_tensor(name)
        if self.fp8_block is not None and t.dtype == torch.float8_e4m3fn:
            scale = f"{name}_scale_inv"
            if scale not in f.keys():
                raise QuantkitError(f"model '{self.source_name}': {name} is FP8 but {scale} is not beside it: the "
                                    "checkpoint is incomplete; download or copy it again")
            t = loader.dequantize_fp8(t, f.get_tensor(scale), self.fp8_block)
        return t

    def check_shapes(self) -> None:
        """Every tensor's shape in the shards (headers only) against the skeleton config.json builds."""
        from safetensors import SafetensorError, safe_open

        by_file = {}
        for n in self.names:
            by_file.setdefault(self.files[n], []).append(n)
        for fname, group in by_file.items():
            try:
                with safe_open(self.folder / fname, framework="pt") as f:
                    shapes = {n: _stored_shape(f, self.stored[n]) for n in group}
            except (SafetensorError, OSError) as e:
                raise QuantkitError(f"a safetensors file of model '{self.source_name}' is truncated or corrupted "
                                    f"({fname}: {e}): download or copy the model again") from e
            for n, shape in shapes.items():
                want = list(_get(self.model, n).shape)
                if shape != want:
                    raise QuantkitError(f"model '{self.source_name}': tensor {n} is {shape} in {fname}, but "
                                        f"config.json makes it {want}: the weights and config.json disagree; download "
                                        "or copy the model again")

    def under(self, prefix: str) -> list[str]:
        return [n for n in self.names if n.startswith(prefix + ".")]

    def load(self, prefix: str, skip=()) -> nn.Module:
        """The module at `prefix` with its tensors real (but those named in `skip`), in the compute dtype."""
        self.load_names([n for n in self.under(prefix) if n not in set(skip)])
        return self.model.get_submodule(prefix)

    def load_names(self, names) -> None:
        for name, t in self.read(names, self.dtype).items():
            assign_tensor(self.model, name, t)

    def release(self, prefix: str) -> None:
        self.release_names(self.under(prefix))

    def release_names(self, names) -> None:
        for name in names:
            t = _get(self.model, name)
            assign_tensor(self.model, name, torch.empty(t.shape, dtype=t.dtype, device="meta"))

    def load_outside(self, blocks_path: str, device="cpu"):
        """Pre-hooks that load each module outside the blocks on first use; returns a function undoing all. Two
        reads come before a module's own call, so their tensors load earlier: the decoder's code may read a weight
        of a module it holds before calling it (Kosmos-2.5's `segment_emb(torch.zeros(..., device=
        segment_emb.weight.device))`), so the tensors of the module holding the blocks load when its forward starts
        (those of a model or a list of layers beside the blocks, a vision tower, on their own first use); and a
        transformers model's forward may ask its `.device`, its first parameter's (Idefics3's
        `embed_tokens(input_ids).to(self.device)`, whose first parameter is the vision tower's, which a text
        forward never runs), so that parameter loads with the model's own."""
        handles, loaded = [], []
        inside = (lambda n: n == blocks_path or n.startswith(blocks_path + "."))
        decoder = blocks_path.rpartition(".")[0]
        by_id = {id(_get(self.model, n)): n for n in self.names}
        for mod_name, module in self.model.named_modules():
            if inside(mod_name):
                continue
            own = [n for n in self.names if n.rpartition(".")[0] == mod_name]
            if mod_name == decoder:
                own = _held_by(module, decoder, self.names)
            first = by_id.get(id(next(module.parameters(), None))) if hasattr(type(module), "device") else None
            if first is not None and first not in own and not inside(first.rpartition(".")[0]):
                own.append(first)
            if not own:
                continue

            def hook(m, args, own=own):
                for name, t in self.read([n for n in own if _get(self.model, n).is_meta], self.dtype).items():
                    assign_tensor(self.model, name, t.to(device))
                    loaded.append(name)
            handles.append(module.register_forward_pre_hook(hook))

        def undo():
            for h in handles:
                h.remove()
            for name in loaded:
                t = _get(self.model, name)
                assign_tensor(self.model, name, torch.empty(t.shape, dtype=t.dtype, device="meta"))
        return undo


def _held_by(decoder: nn.Module, prefix: str, names) -> list[str]:
    """The tensor names (of `names`) under the module `decoder` at `prefix`, but those inside a list of layers (the
    blocks, or any beside them) or a transformers model it holds (a vision tower)."""
    full = (lambda n: ".".join(p for p in (prefix, n) if p))
    apart = [full(n) + "." for n, m in decoder.named_modules()
             if n and (isinstance(m, nn.ModuleList) or hasattr(type(m), "device"))]
    return [n for n in names if (not prefix or n.startswith(prefix + ".")) and not n.startswith(tuple(apart))]


def _stored_shape(f, stored) -> list:
    """The shape of a stored tensor (its name) or of one expert's slice of it ((name, expert)), from the header."""
    if isinstance(stored, tuple):
        return f.get_slice(stored[0]).get_shape()[1:]
    return list(f.get_slice(stored).get_shape())


def unloaded_tensors(files: dict, loaded: set, fp8: bool) -> list[str]:
    """The tensors of a folder's shards (files: {name: shard}) that the model does not load (`loaded`: the names in the
    files of the model's own tensors): multi-token-prediction layers (GLM-4.5's model.layers.N past the last block,
    Qwen3-Next's mtp.*, DeepSeek-V3's layer 61) and anything else transformers leaves out. A quantize run carries
    them into its output unchanged. An FP8 source's block scales of loaded weights are not among them: the reader
    consumed them."""
    def consumed(n):
        return fp8 and n.endswith("_scale_inv") and n.removesuffix("_scale_inv") in loaded
    return sorted(n for n in files if n not in loaded and not consumed(n))


class InMemoryModel(StreamedModel):
    """The whole model loaded (sources that cannot be streamed): load/release are no-ops. unloaded: tensors of the
    source's files the model did not load, to be carried (read from `folder`, when the source is one)."""

    def __init__(self, model, source_name: str, folder: Path | None = None, unloaded=()):
        self.model, self.source_name, self.dtype = model, source_name, model.dtype
        self.names = list(drop_shared(model.state_dict()))
        self._state = model.state_dict()
        self.folder, self.unloaded, self.seen = folder, list(unloaded), {}
        self.files = shard_map(folder) if folder is not None and self.unloaded else {}

    def read(self, names, dtype=None) -> dict:
        return {n: self._state[n].to(dtype) if dtype is not None and self._state[n].is_floating_point()
                else self._state[n] for n in names}

    def load(self, prefix, skip=()):
        return self.model.get_submodule(prefix)

    def split_sliced(self, params) -> None:
        split_sliced(self.model, params)
        self.names = list(drop_shared(self.model.state_dict()))
        self._state = self.model.state_dict()

    def load_names(self, names):
        pass

    def release(self, prefix):
        pass

    def release_names(self, names):
        pass

    def load_outside(self, blocks_path, device="cpu"):
        return lambda: None

    def _check_unchanged(self, fname: str) -> None:
        pass


_IN_LIST = re.compile(r"\.\d+\.")  # a name inside a list of layers


def _distinct_state_names(model) -> list[str]:
    seen, names = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            names.append(name)
    return names


def _get(model, name):
    mod, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(mod), leaf)


def assign_tensor(model, name, t):
    """Put tensor t in place of the parameter or buffer `name` of model (a parameter stays one, frozen)."""
    mod, _, leaf = name.rpartition(".")
    module = model.get_submodule(mod)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[leaf] = t


def compute_dtype_for(config, dtype):
    """What from_pretrained(dtype=...) would give: the named dtype, or the config's for 'auto' (fp32 unknown)."""
    parsed = loader.parse_dtype(dtype)
    if parsed != "auto":
        return parsed
    declared = getattr(config, "dtype", None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


def open_model(source: str, dtype="auto", trust_remote_code=False, tokenizer_required=True):
    """(StreamedModel or InMemoryModel, tokenizer, stored dtype) for a quantization run (or a streamed
    evaluation). trust_remote_code: run the model's own code (config.json auto_map); off unless asked.
    tokenizer_required=False (a data-free run): a model without usable tokenizer files gives None, with a note."""
    source = str(source)
    why = "it is not a local safetensors folder, which is read block by block"
    if loader.looks_local(source):
        loader.check_local_folder(source)
        files = shard_map(Path(source).expanduser())
        if files is not None:
            streamed = _streamed(source, files, dtype, trust_remote_code, tokenizer_required)
            if not isinstance(streamed, str):
                return streamed
            why = streamed
    # a bad id fails here, note unsaid
    fp_model, tokenizer = loader.load_fp_model(source, dtype, trust_remote_code, tokenizer_required)
    print(f"note: {source} was loaded whole: {why}", file=sys.stderr)
    folder = Path(source).expanduser() if loader.looks_local(source) else None
    files = (shard_map(folder) or {}) if folder is not None else {}
    unloaded = [n for n in fp_model.unloaded_tensors if n in files]
    if len(unloaded) < len(fp_model.unloaded_tensors):
        print(f"note: {len(fp_model.unloaded_tensors) - len(unloaded)} tensors of {source} that transformers does not "
              f"load (such as {fp_model.unloaded_tensors[0]}) are not carried into the output: they are read from a "
              "local folder only; download the model to a folder to keep them", file=sys.stderr)
    source_model = InMemoryModel(fp_model, source, folder, unloaded)
    return source_model, tokenizer, loader.stored_dtype(fp_model, trust_remote_code)


def _streamed(source: str, files: dict, dtype, trust_remote_code, tokenizer_required):
    """open_model's result for a local safetensors folder read block by block, or why it cannot be."""
    from transformers import AutoConfig

    folder = Path(source).expanduser()
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise loader.load_error(source, e) from e
    fp8_block = loader.fp8_block_size(config)
    if fp8_block is not None:  # the model is built in floating point; the reader dequantizes the FP8 weights
        del config.quantization_config
        print(f"note: {source} holds block-scaled FP8 weights ({fp8_block[0]} x {fp8_block[1]} blocks): "
              "they are dequantized as they are read and quantized as any floating-point weight", file=sys.stderr)
    elif getattr(config, "quantization_config", None):
        loader.refuse_quantized(source, config)  # what passes is MXFP4, which transformers dequantizes as it loads
        return "transformers dequantizes its MXFP4 experts as it loads"
    declared = _declared(config)  # before from_config, which sets config.dtype to the compute dtype
    model = StreamedModel(folder, config, compute_dtype_for(config, dtype), files, source, trust_remote_code,
                          fp8_block)
    if _held_twice(model.model):
        return (f"its layers share weights ({_held_twice(model.model)}, for one: Zamba's shared attention block), "
                "which loading one block at a time would leave empty in the others")
    if all(n in model.files for n in model.names):  # else renamed or missing tensors: transformers decides
        model.check_shapes()
        return model, loader.load_tokenizer(folder, trust_remote_code, tokenizer_required), declared
    missing = next(n for n in model.names if n not in model.files)
    return (f"its files name tensors otherwise than the model does ({missing}, for one, is not stored as such: "
            "transformers converts such tensors as it loads, e.g. per-expert weights into fused 3-D ones), so they "
            "cannot be read block by block")


def _held_twice(model: nn.Module) -> str | None:
    """The name of a weight two layers of a list hold, one tensor (Zamba's shared attention block, tied into every
    hybrid layer), or None. A tied embedding and head is not one: the stream reads those once, outside the blocks."""
    seen = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = seen.setdefault(id(p), name)
        if first != name and _IN_LIST.search(first) and _IN_LIST.search(name):
            return first
    return None


def _declared(config):
    declared = getattr(config, "dtype", None)
    return declared if isinstance(declared, torch.dtype) else torch.float32
