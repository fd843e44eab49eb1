"""Hugging Face safetensors folder conventions shared by the source reader and the checkpoint writer."""

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
