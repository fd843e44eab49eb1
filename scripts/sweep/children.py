"""The child processes of the sweep (`python scripts/family_sweep.py --child build|check ...`: a crash or a hang
costs one row) and how the parent runs them and reads their answers."""
import json
import subprocess
import sys
from pathlib import Path

from sweep.common import one_line, quiet, without_cache
from sweep.heldout import held_out_ids
from sweep.tiny_build import NotADecoder, NotBuilt, build_tiny

SCRIPT = Path(__file__).resolve().parents[1] / "family_sweep.py"  # the children run the sweep's own entry point
ANSWER = "family_sweep> "  # a child's JSON answer is the stdout line that starts so


def child_build(model_type: str, folder: str, reference_path: str, text: str, part: str = "head") -> dict:
    """Builds the model; saves the held-out ids it is compared on (taken from the `part` of `text`: "head", or
    "tail" where `text` is the calibration file itself) and the fp model's logits on them (its bf16 weights in
    float32), the reference every quantized model is compared with."""
    import torch
    import transformers
    from transformers import AutoConfig

    try:
        build_tiny(model_type, folder)
    except (NotBuilt, NotADecoder) as e:
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 (the tokenizer, saving: the row says what)
        return {"error": one_line(e)}
    model_class = getattr(transformers, AutoConfig.from_pretrained(folder).architectures[0])  # the class saved
    model = quiet(model_class.from_pretrained, folder, dtype=torch.float32).eval()
    ids = held_out_ids(folder, model.config, Path(text), from_end=part == "tail")
    torch.save({"ids": ids, "logits": fp_logits(model, ids)}, reference_path)
    text_config = model.config.get_text_config(decoder=True)
    layers = getattr(text_config, "layer_types", None) or getattr(text_config, "num_hidden_layers", None)
    return {"layers": layers if isinstance(layers, int) else len(layers or []),
            "params": sum(p.numel() for p in model.parameters()), "class": type(model).__name__,
            "repair": getattr(model.config, "family_sweep_repair", "")}


def child_check(out: str, reference_path: str) -> dict:
    """load_quantized(out) and its forward on the held-out ids: {stage reached, relative logits error}."""
    import torch

    import quantkit

    reference = torch.load(reference_path)
    try:
        model = quantkit.load_quantized(out, device="cpu", dtype=torch.float32)  # as the reference
    except Exception as e:  # noqa: BLE001 (any failure is the row's result)
        return {"stage": "load", "error": one_line(e)}
    try:
        logits = fp_logits(model, reference["ids"])
    except Exception as e:  # noqa: BLE001
        return {"stage": "forward", "error": one_line(e)}
    ref = reference["logits"]
    if logits.shape != ref.shape or not torch.isfinite(logits).all():
        return {"stage": "forward", "error": f"logits {tuple(logits.shape)} not finite or not {tuple(ref.shape)}"}
    return {"stage": "ok", "rel": ((logits - ref).norm() / ref.norm()).item()}


def fp_logits(model, ids):
    """The model's float32 logits on ids [windows, tokens], one window at a time: every family ran its checks
    with a batch of one, and some models' code (position ids, masks) is only sure to hold for that."""
    import torch

    with torch.inference_mode():
        return torch.cat([model(input_ids=window[None], **without_cache(model)).logits.float() for window in ids])


def run_child(argv: list, timeout: float, env=None) -> tuple:
    """(exit code or None on timeout, stdout, stderr) of a command, its whole process group killed on timeout."""
    import os
    import signal

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def child_json(argv: list, timeout: float, env=None) -> tuple:
    """Runs `python this_script --child ...`: (its JSON answer or None, why not: 'timeout' or the error line)."""
    rc, out, err = run_child([sys.executable, str(SCRIPT), "--child", *argv], timeout, env)
    if rc is None:
        return None, "timeout"
    lines = [line for line in out.splitlines() if line.startswith(ANSWER)]
    if rc == 0 and lines:
        return json.loads(lines[-1][len(ANSWER):]), None
    return None, error_line(err) or f"exit code {rc}"


def error_line(stderr: str) -> str:
    """quantkit's `error: ...` line, else a traceback's last line, else the last line (tqdm's bars aside)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and "%|" not in line]  # no progress bars
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1][:300]
