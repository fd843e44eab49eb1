"""A quantized model against its floating-point base, token by token, as llama.cpp's --kl-divergence does.

Windows: those of `quantkit eval perplexity` (non-overlapping, `seqlen` tokens; position t predicts
token t + 1), so N = windows x (seqlen - 1) positions. At each position, from log-softmax in fp32
over the full vocabulary:
  KLD     KL(P_base || P_quant) = sum_v p_base(v) (log p_base(v) - log p_quant(v))
  top-1   whether both models' most likely next token is the same
  Δp      p_quant(t*) - p_base(t*) for the base model's most likely token t*
  NLL     of the real next token, for each model's perplexity
Summaries: mean with its standard error (sample std / sqrt(N)), median and percentiles (numpy's
linear interpolation), max.

Memory: the direct mode holds both models. With low_memory the base model runs over every window
first and its fp32 log-probs go to a temporary file (N x vocab x 4 bytes, checked against the free
disk space), then it is freed and the quantized model runs, reading them back window by window: one
model in memory at a time, and exactly the numbers of the direct mode (the cache is lossless fp32).
Chosen over caching top-k log-probs because KL needs the whole base distribution to be exact.
"""
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from quantkit.calibration.data import check_dataset
from quantkit.checkpoint.files import REPORT_NAME, read_report
from quantkit.core.errors import QuantkitError
from quantkit.core.textfile import check_path_name, read_user_text
from quantkit.core.units import size_text
from quantkit.eval import (check_eval_options, check_seqlen, eval_ids, is_quantized_folder, load_any, model_device,
                           model_logits, split_windows)
from quantkit.models.arch import check_window
from quantkit.models.hub import load_tokenizer


def mean_stderr(values: np.ndarray) -> dict:
    """mean and its standard error (sample std / sqrt(N)) of per-token values, in float64."""
    v = np.asarray(values, dtype=np.float64)
    return {"mean": float(v.mean()), "stderr": float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0}


def summarize(values: np.ndarray) -> dict:
    """mean, stderr, median, p90, p99, p999, max of per-token values (float64)."""
    v = np.asarray(values, dtype=np.float64)
    median, p90, p99, p999 = np.percentile(v, [50, 90, 99, 99.9])
    return {**mean_stderr(v), "median": float(median), "p90": float(p90), "p99": float(p99),
            "p999": float(p999), "max": float(v.max())}


def window_logprobs(model, window: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs [seqlen - 1, vocab] of the next token at every position but the last, on CPU."""
    with torch.inference_mode():
        logits = model_logits(model, window.unsqueeze(0).to(model_device(model)))[0, :-1]
        return torch.log_softmax(logits.float(), dim=-1).cpu()


def position_stats(base: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor) -> dict:
    """Per-position figures of two [positions, vocab] fp32 log-prob tensors and the real next tokens."""
    if base.shape != quant.shape:
        raise QuantkitError(f"the models predict over different vocabularies ({base.shape[-1]} vs {quant.shape[-1]} "
                            "tokens): compare a quantized model with its own base model")
    p = base.exp()
    kld = torch.where(p > 0, p * (base - quant), torch.zeros_like(p)).sum(dim=-1)
    top = base.argmax(dim=-1, keepdim=True)
    rows = torch.arange(len(targets))
    return {"kld": kld, "top1": (quant.argmax(dim=-1, keepdim=True) == top).squeeze(-1).float(),
            "delta_p": (quant.gather(-1, top).exp() - p.gather(-1, top)).squeeze(-1),
            "nll_base": -base[rows, targets], "nll_quant": -quant[rows, targets]}


class Accumulator:
    """Collects position_stats window by window and summarizes them."""

    def __init__(self):
        self.parts = {}

    def add(self, stats: dict) -> None:
        for key, value in stats.items():
            self.parts.setdefault(key, []).append(value.double().numpy())

    def summary(self, seqlen: int) -> dict:
        v = {k: np.concatenate(parts) for k, parts in self.parts.items()}
        ppl_base, ppl_quant = math.exp(v["nll_base"].mean()), math.exp(v["nll_quant"].mean())
        return {"tokens": int(v["kld"].size), "windows": int(v["kld"].size // (seqlen - 1)), "seqlen": seqlen,
                "ppl": {"base": ppl_base, "quant": ppl_quant, "delta": ppl_quant - ppl_base},
                "kld": summarize(v["kld"]), "top1": mean_stderr(v["top1"]), "delta_p": mean_stderr(v["delta_p"])}


def compare_models(base, quant, input_ids: torch.Tensor, seqlen: int, progress: bool = True) -> dict:
    """The direct mode: both models in memory, window by window."""
    windows = _prepare(input_ids, seqlen)
    acc = Accumulator()
    for window in tqdm(windows, desc="compare", unit="window", disable=not progress):
        acc.add(position_stats(window_logprobs(base, window), window_logprobs(quant, window), window[1:]))
    return acc.summary(seqlen)


def compare_low_memory(load_base, load_quant, input_ids: torch.Tensor, seqlen: int, cache_dir=None,
                       progress: bool = True, visit=None) -> dict:
    """One model at a time: load_base() -> log-probs cached on disk -> freed -> load_quant() reads them back.

    visit(role, model), if given, sees each model ("base", then "quant") before it is freed."""
    windows = _prepare(input_ids, seqlen)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix="quantkit-compare-") as tmp:
        base = load_base()
        cache = None
        for i, window in enumerate(tqdm(windows, desc="base", unit="window", disable=not progress)):
            logp = window_logprobs(base, window)
            if cache is None:
                cache = _open_cache(Path(tmp), (len(windows), *logp.shape))
            cache[i] = logp.numpy()
        if visit is not None:
            visit("base", base)
        del base
        quant = load_quant()
        acc = Accumulator()
        for i, window in enumerate(tqdm(windows, desc="quantized", unit="window", disable=not progress)):
            acc.add(position_stats(torch.from_numpy(np.array(cache[i])), window_logprobs(quant, window), window[1:]))
        if visit is not None:
            visit("quant", quant)
        del cache, quant
    return acc.summary(seqlen)


def _prepare(input_ids, seqlen) -> torch.Tensor:
    stream = input_ids.reshape(-1)
    check_eval_options(stream.numel(), seqlen, 1)
    return split_windows(stream, seqlen)


def check_cache_dir(cache_dir) -> None:
    """The folder --low-memory caches in takes a file, checked before any model loads."""
    try:
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix="quantkit-compare-"):
            pass
    except OSError as e:
        where = f"--cache-dir {cache_dir}" if cache_dir else f"the temporary folder {tempfile.gettempdir()}"
        raise QuantkitError(f"--low-memory cannot write its cache to {where} ({e.strerror}): pass --cache-dir with a "
                            "folder you can write to") from None


def _open_cache(folder: Path, shape) -> np.memmap:
    need = 4 * math.prod(shape)
    free = shutil.disk_usage(folder).free
    if need > free * 0.95:
        raise QuantkitError(f"the low-memory comparison caches {size_text(need)} of base log-probs, but only "
                            f"{size_text(free)} are free in {folder.parent}: pass --cache-dir on a larger disk, "
                            "fewer --max-tokens, or run without --low-memory")
    return np.lib.format.open_memmap(folder / "base_logprobs.npy", mode="w+", dtype=np.float32, shape=shape)


# --------------------------------------------------------------------------- generations


def greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """Token ids of the greedy continuation of `prompt` (prompt excluded)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model_device(model))
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0)
    return out[0, ids.shape[1]:].tolist()


def first_divergence(a: list[int], b: list[int]):
    """Index of the first token where two continuations differ, None when one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def side_by_side(tokenizer, prompt: str, base: list[int], quant: list[int]) -> dict:
    """Both continuations as text, with ⟦…⟧ around the first token where the quantized one departs."""
    i = first_divergence(base, quant)

    def marked(ids):
        whole = tokenizer.decode(ids)
        if i is None or i >= len(ids):
            return whole
        # decode growing prefixes, not pieces: a piece alone loses the space a tokenizer attaches to it
        before, through = tokenizer.decode(ids[:i]), tokenizer.decode(ids[:i + 1])
        if not (through.startswith(before) and whole.startswith(through)):
            return f"{before}⟦{tokenizer.decode(ids[i:])}⟧"
        return f"{before}⟦{through[len(before):]}⟧{whole[len(through):]}"

    return {"prompt": prompt, "base": marked(base), "quant": marked(quant), "first_divergence": i}


def read_prompts(text: str) -> list[str]:
    """A file (one prompt per non-empty line, UTF-8) or the prompt itself. A value that looks like a path (one word
    with a slash or a file suffix, or a folder) but is no readable file is refused: taken as a prompt, a mistyped
    file name would be compared in silence."""
    one_word = not any(c.isspace() for c in text)
    if one_word:
        check_path_name(text, "--prompts")
    path = Path(text).expanduser()
    if not path.exists():
        if one_word and ("/" in text or path.suffix):
            raise QuantkitError(f"--prompts file {text} not found: pass an existing text file with one prompt per "
                                "line (or a prompt of more than one word)")
        return [text]
    lines = read_user_text(path, "prompt file", "a text file with one prompt per line").splitlines()
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise QuantkitError(f"prompt file {text} holds no prompt: write one per line")
    return prompts


# --------------------------------------------------------------------------- paths (what the CLI compares)


def check_same_tokenizer(base_tok, quant_tok) -> None:
    a, b = base_tok.get_vocab(), quant_tok.get_vocab()
    if a != b:
        raise QuantkitError(f"the two models use different tokenizers ({len(a)} and {len(b)} tokens, "
                            f"{len(set(a.items()) ^ set(b.items()))} entries differ): compare a quantized model with "
                            "the model it was made from")


# What a quantized checkpoint keeps of the model it was made from (transformers maps the families' own names).
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")


def warn_if_unrelated(base_config, quant_config, base, quant) -> None:
    """One warning line when the quantized model cannot have been made from the base (another family or shape):
    its KLD and agreement would compare two different models, not measure quantization."""
    differ = [f"{f} {getattr(quant_config, f, None)} vs {getattr(base_config, f, None)}" for f in SHAPE_FIELDS
              if getattr(quant_config, f, None) != getattr(base_config, f, None)]
    if differ:
        print(f"warning: {quant} was not quantized from {base} ({', '.join(differ)}): these figures compare two "
              "different models; pass the model it was made from as --base", file=sys.stderr)


def check_prompt_lengths(config, tokenizer, prompts, max_new_tokens: int) -> None:
    """Before any work: a prompt and its continuation must fit the model's context (past it a RoPE model rambles
    on positions it never saw, a learned position table fails)."""
    for prompt in prompts:
        n = len(tokenizer(prompt).input_ids)
        check_window(config, n + max_new_tokens, f"the prompt {prompt[:40]!r} ({n} tokens) plus --max-new-tokens "
                     f"{max_new_tokens}", lambda limit: f"use --max-new-tokens {max(limit - n, 0)} or less, or a "
                     "shorter prompt")


def recorded_base(quant) -> str:
    """The model `quantkit quantize` made QUANT from, as its report names it (a local source is recorded as an
    absolute path), for `eval compare` without --base."""
    if not Path(quant).is_dir():
        raise QuantkitError(f"{quant} is not a local folder, so no quantkit report names its base model: pass --base "
                            "MODEL (or check the path)")
    if not is_quantized_folder(quant):
        raise QuantkitError(f"{quant} is not a quantized checkpoint (no quantization_config), so it was not made from "
                            "another model: pass the quantized folder as QUANT, or --base MODEL to compare two models")
    base = read_report(quant).get("model")
    if base is None:
        raise QuantkitError(f"{quant} does not name the model it was made from (no {REPORT_NAME} with a "
                            "\"model\": other tools' checkpoints, and those converted from them, have none): "
                            "pass --base MODEL")
    if Path(base).is_absolute() and not Path(base).is_dir():
        raise QuantkitError(f"{quant} was made from {base}, which is no longer there: pass --base MODEL")
    return base


def compare_paths(quant: str, base: str, dataset: str, seqlen: int, max_tokens=None, device="auto", dtype=None,
                  low_memory=False, cache_dir=None, prompts=(), max_new_tokens=32, progress=True, stream=False,
                  trust_remote_code=False) -> dict:
    """`quantkit eval compare`: the figures of compare_models (or compare_low_memory) on `dataset`, plus the
    greedy continuations of each prompt by both models."""
    from transformers import AutoConfig

    check_seqlen(seqlen)
    check_dataset(dataset)   # before the tokenizers, configs and weights: a typo is named at once
    if low_memory:
        check_cache_dir(cache_dir)
    tokenizers = {role: load_tokenizer(path, trust_remote_code) for role, path in (("base", base), ("quant", quant))}
    check_same_tokenizer(tokenizers["base"], tokenizers["quant"])
    configs = {role: AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
               for role, path in (("base", base), ("quant", quant))}
    warn_if_unrelated(configs["base"], configs["quant"], base, quant)
    tokenizer = tokenizers["base"]
    check_prompt_lengths(configs["base"], tokenizer, prompts, max_new_tokens)
    ids = eval_ids(tokenizer, dataset, max_tokens)
    continuations = {}

    def visit(role, model):
        continuations[role] = [greedy(model, tokenizer, p, max_new_tokens) for p in prompts]

    def load(path):
        return load_any(path, device, dtype, stream, trust_remote_code)[0]

    if low_memory:
        result = compare_low_memory(lambda: load(base), lambda: load(quant), ids, seqlen, cache_dir, progress, visit)
    else:
        base_model, quant_model = load(base), load(quant)
        result = compare_models(base_model, quant_model, ids, seqlen, progress)
        visit("base", base_model)
        visit("quant", quant_model)
    result["generations"] = [side_by_side(tokenizer, p, b, q)
                             for p, b, q in zip(prompts, continuations["base"], continuations["quant"])]
    return result


def report_text(result: dict, quant: str, base: str, dataset: str) -> str:
    k, t, d, ppl = result["kld"], result["top1"], result["delta_p"], result["ppl"]
    lines = [f"{quant} against {base} on {dataset}: {result['tokens']} predicted tokens "
             f"({result['windows']} windows of {result['seqlen']})",
             "", "| | base | quantized | Δ |", "|---|---|---|---|",
             f"| perplexity | {ppl['base']:.4f} | {ppl['quant']:.4f} | {ppl['delta']:+.4f} |", "",
             f"KL divergence (base ‖ quantized), nats/token: mean {k['mean']:.6f} ± {k['stderr']:.6f}, median "
             f"{k['median']:.6f}, p90 {k['p90']:.6f}, p99 {k['p99']:.6f}, p99.9 {k['p999']:.6f}, max {k['max']:.6f}",
             f"top-1 agreement: {100 * t['mean']:.2f} % ± {100 * t['stderr']:.2f} %",
             f"mean Δp of the base model's top token: {100 * d['mean']:+.3f} % ± {100 * d['stderr']:.3f} %"]
    for g in result["generations"]:
        where = "identical" if g["first_divergence"] is None else f"first divergence at token {g['first_divergence']}"
        lines += ["", f"prompt: {g['prompt']!r} ({where}, marked ⟦…⟧)", f"  base:      {g['base']!r}",
                  f"  quantized: {g['quant']!r}"]
    return "\n".join(lines)
