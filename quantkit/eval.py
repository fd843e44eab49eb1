"""Perplexity of a causal LM on a token stream, by the protocol of the GPTQ evaluation scripts (eval_ids: a dataset's
evaluation stream), and of a path (a quantized folder or a floating-point model) as `quantkit eval perplexity` runs
it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quantkit.calibration.data import CUT_MARGIN, check_dataset, check_positive, token_stream
from quantkit.checkpoint.files import has_quantization_config, read_config
from quantkit.core.errors import QuantkitError
from quantkit.core.matmul import onednn_linears
from quantkit.models import offload
from quantkit.models.arch import arch_for, check_window
from quantkit.models.hub import load_fp_model, load_tokenizer, resolve_device
from quantkit.models.placement import move_loaded
from quantkit.models.stream import InMemoryModel, open_model
from quantkit.run.load import checkpoint_dtype, load_quantized

# Positions per cross-entropy call: bounds the float32 copy of the logits to
# _LOSS_CHUNK x vocab floats (e.g. 1024 x 152k x 4 B ≈ 0.6 GB for Qwen) however long the window.
_LOSS_CHUNK = 1024


def eval_ids(tokenizer, dataset: str, max_tokens: int | None = None) -> torch.LongTensor:
    """The evaluation stream of `dataset` (quantkit.calibration.data reads it) as LongTensor [1, T].

    Protocol (GPTQ eval scripts): tokenizer("\\n\\n".join(texts), return_tensors="pt") over the
    eval split, cut to the first `max_tokens` tokens when given. With `max_tokens` only the leading
    documents needed for that many tokens (plus a margin) are tokenized; the result is identical
    to tokenizing everything and then cutting.
    """
    if max_tokens is None:
        return token_stream(tokenizer, dataset, "eval").unsqueeze(0)
    check_positive(max_tokens, "--max-tokens")
    return token_stream(tokenizer, dataset, "eval", max_tokens + CUT_MARGIN)[:max_tokens].unsqueeze(0)


def perplexity(model, input_ids: torch.LongTensor, seqlen: int, batch_size: int = 1, progress: bool = True) -> dict:
    """Perplexity of `model` on `input_ids` [1, T].

    Protocol (GPTQ / AWQ / most papers): cut the stream into T // seqlen non-overlapping windows of
    `seqlen` tokens, dropping the last partial window; run each window on its own (no context from
    the previous one); every window predicts its tokens 1..seqlen-1. With N = windows * (seqlen - 1)
    predicted tokens, nll = sum of their negative log-likelihoods / N and ppl = exp(nll).

    Logits are computed in the model's dtype on the model's device, the loss in float32. Windows run
    `batch_size` at a time, so at most one batch of full-vocabulary logits is alive.

    Returns {"ppl": float, "nll": float, "tokens": N, "windows": int, "seqlen": int}.
    """
    stream = _as_stream(input_ids)
    check_eval_options(stream.numel(), seqlen, batch_size)
    windows = split_windows(stream, seqlen)
    device = model_device(model)

    total_nll = 0.0  # python float (double): summing ~1e6 token losses in fp32 would drift
    tokens_done = 0
    was_training = model.training
    model.eval()  # dropout off
    try:
        with torch.inference_mode(), tqdm(total=len(windows), desc="perplexity", unit="window", disable=not progress) as bar:
            for batch in windows.split(batch_size):
                batch = batch.to(device)
                total_nll += _batch_nll_sum(model_logits(model, batch), batch)
                tokens_done += batch.shape[0] * (seqlen - 1)
                bar.update(batch.shape[0])
                bar.set_postfix(ppl=f"{math.exp(total_nll / tokens_done):.3f}")
    finally:
        model.train(was_training)

    nll = total_nll / tokens_done
    return {"ppl": math.exp(nll), "nll": nll, "tokens": tokens_done, "windows": len(windows), "seqlen": seqlen}


def _as_stream(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        return input_ids[0]
    if input_ids.dim() == 1:
        return input_ids
    raise ValueError(f"input_ids must be one token stream of shape [1, T], got {tuple(input_ids.shape)}")


def check_seqlen(seqlen: int) -> None:
    """Before anything is loaded: a window of fewer than 2 tokens predicts nothing."""
    if seqlen < 2:
        raise QuantkitError(f"--seqlen must be at least 2 to predict any token, got {seqlen}")


def check_eval_options(n_tokens: int, seqlen: int, batch_size: int) -> None:
    check_seqlen(seqlen)
    if batch_size < 1:
        raise QuantkitError(f"--batch-size must be at least 1, got {batch_size}")
    if n_tokens < seqlen:
        raise QuantkitError(
            f"the evaluation text has only {n_tokens} tokens, fewer than one window of --seqlen {seqlen}: "
            "use a smaller --seqlen or more text (a longer file or a larger --max-tokens)"
        )


def split_windows(stream: torch.Tensor, seqlen: int) -> torch.Tensor:
    """[n_windows, seqlen] non-overlapping windows; the trailing partial window is dropped."""
    n_windows = stream.numel() // seqlen
    return stream[: n_windows * seqlen].reshape(n_windows, seqlen)


def model_device(model) -> torch.device:
    # HF models expose .device (the first parameter's device, where the embedding lives even under
    # accelerate's device_map dispatch); plain modules fall back to their first parameter.
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def model_logits(model, batch: torch.Tensor) -> torch.Tensor:
    check_window(getattr(model, "config", None), batch.shape[-1], f"--seqlen {batch.shape[-1]}")
    with onednn_linears(model):  # float32 CPU products through oneDNN (quantkit.core.matmul)
        output = model(batch, use_cache=False)  # no KV cache: each window is one forward pass
    return output.logits if hasattr(output, "logits") else output[0]


def _batch_nll_sum(logits: torch.Tensor, batch: torch.Tensor) -> float:
    """Sum over the batch of -log p(token t | tokens < t) for t = 1..seqlen-1, in float32."""
    predictions = logits[:, :-1]  # position t predicts token t + 1
    targets = batch[:, 1:].to(logits.device)
    total = 0.0
    for start in range(0, targets.shape[1], _LOSS_CHUNK):
        chunk_logits = predictions[:, start : start + _LOSS_CHUNK].float()
        chunk_targets = targets[:, start : start + _LOSS_CHUNK]
        total += F.cross_entropy(chunk_logits.reshape(-1, chunk_logits.shape[-1]), chunk_targets.reshape(-1), reduction="sum").item()
    return total


# --------------------------------------------------------------------------- paths (what the CLI evaluates)


def is_quantized_folder(path) -> bool:
    return has_quantization_config(path)


def load_any(path, device="auto", dtype=None, stream=False, trust_remote_code=False):
    """(model, tokenizer) for a quantized folder or a floating-point model (folder or hub id).
    stream: keep the decoder blocks on disk and read each as it runs (quantkit.models.offload).
    trust_remote_code: run a floating-point model's own code (config.json auto_map); off by default."""
    device = resolve_device(device)
    if is_quantized_folder(path):
        model = load_quantized(path, device=device, dtype=dtype or _quantized_eval_dtype(path, device), stream=stream)
        return model, load_tokenizer(path)
    dtype = dtype or ("float32" if device == "cpu" else "auto")
    if stream:
        return _stream_fp_model(path, device, dtype, trust_remote_code)
    model, tokenizer = load_fp_model(path, dtype, trust_remote_code)
    return model.to(device), tokenizer


def _quantized_eval_dtype(path, device: str) -> torch.dtype:
    """What evaluation computes a quantized folder in by default (--dtype's help): float32 on the CPU (exact: a
    perplexity there is the fp32 model's protocol), the checkpoint's half type on a GPU (float16 for another)."""
    if device == "cpu":
        return torch.float32
    own = checkpoint_dtype(read_config(path))
    return own if own in (torch.float16, torch.bfloat16) else torch.float16


def _stream_fp_model(path, device, dtype, trust_remote_code):
    """A floating-point model with its blocks read from the safetensors shards as they run; a source that cannot
    be streamed (hub id, .bin weights) is loaded whole, with a note (quantkit.models.stream.open_model)."""
    source, tokenizer, _ = open_model(path, dtype, trust_remote_code)
    model = source.model
    if not isinstance(source, InMemoryModel):
        units = offload.stream_model(model, arch_for(model).blocks, source.read, set(source.names), device)
        source.load_names([n for n in source.names if not offload.under(n, units)])
        model.tie_weights()  # the embedding was just assigned: a tied head must point at it again
    move_loaded(model, device)
    return model, tokenizer


def evaluate_path(path, dataset, seqlen, max_tokens=None, device="auto", dtype=None, progress=True,
                  stream=False, trust_remote_code=False) -> dict:
    check_seqlen(seqlen)
    check_dataset(dataset)   # a wrong --dataset is named at once, not after a large model has loaded
    model, tokenizer = load_any(path, device, dtype, stream, trust_remote_code)
    ids = eval_ids(tokenizer, dataset, max_tokens)
    return perplexity(model, ids, seqlen, progress=progress)
