"""The `quantkit` command line: quantize, eval perplexity, inspect, demo."""
import json
import sys

import click

from quantkit.algorithms.registry import method_names
from quantkit.checkpoint.codecs import write_formats
from quantkit.core.errors import QuantkitError
from quantkit.core.options import Option
from quantkit.run.config import QuantConfig, config_options, read_recipe


class _Group(click.Group):
    """Turns QuantkitError (a user mistake) into one line on stderr and exit code 2, and running out of memory
    (CPU, or torch's CUDA OutOfMemoryError) into one line and exit code 1: never a traceback."""

    def main(self, args=None, *rest, **kwargs):
        self.argv = list(sys.argv[1:] if args is None else args)  # what --processes hands on to its processes
        return super().main(args, *rest, **kwargs)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except QuantkitError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)
        except (MemoryError, RuntimeError) as e:
            if not (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"):
                raise
            detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
            click.echo(f"error: out of memory{f' ({detail})' if detail else ''}: this run needs more memory than is "
                       "free on its device; fewer --nsamples or a shorter --seqlen (quantize), --stream (eval), "
                       "--device cpu, or a machine with more memory", err=True)
            ctx.exit(1)


EVAL_DATASET_HELP = ("wikitext2, c4, pileval (their eval split, downloaded from the Hugging Face hub) or a local UTF-8 "
                     "text file (offline).")
ACTIVATION_DTYPE_HELP = ("Activation dtype: float32, float16 or bfloat16 (default: float32 on CPU, float16/bfloat16 on "
                         "GPU).")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="quantkit")
def main():
    """Offline weight quantization for Hugging Face causal LMs (RTN, GPTQ, AWQ -> GPTQ-layout checkpoints;
    TurboQuant, E8 lattice codebooks and rotations -> quantkit format)."""


STREAM_HELP = ("Keep the decoder blocks on disk and read each one when it runs: memory about one block plus the "
               "embeddings, for models larger than RAM (a local safetensors folder; others load whole). Same "
               "numbers, slower: every window reads the blocks again.")
TRUST_HELP = ("Run the model's own Python code (auto_map in its config.json) for architectures transformers does not "
              "ship. Off by default: only pass it for a model whose code you trust.")


def _click_option(option: Option) -> click.Option:
    """The --flag of a run setting (quantkit.core.options.Option), its type, default, choices and help as declared."""
    if option.type is bool:
        return click.Option([option.cli_flag], default=option.default, help=option.help)
    kind = click.Choice(option.choices) if option.choices else option.type
    return click.Option([option.cli_flag], type=kind, default=option.default, help=option.help)


class _ConfigCommand(click.Command):
    """`quantize`: its run settings (QuantConfig's fields and every registered algorithm's options) become --options
    when the command parses or prints help, after -o/--output, so an algorithm a plugin registers has its own."""

    def get_params(self, ctx):
        options = config_options()
        key = tuple(o.name for o in options) + tuple(o.choices for o in options)
        if getattr(self, "_config_key", None) != key:  # built once per set of registered algorithms and methods
            self._config_params, self._config_key = [_click_option(o) for o in options], key
        params = super().get_params(ctx)
        at = next(i for i, p in enumerate(params) if p.name == "out") + 1
        return params[:at] + self._config_params + params[at:]


def build_config(ctx, params: dict, recipe_path) -> QuantConfig:
    """Defaults < recipe file < options given on the command line."""
    from click.core import ParameterSource

    values = read_recipe(recipe_path) if recipe_path else {}
    settings = {o.name for o in config_options()}
    for name, value in params.items():
        if name in settings:
            explicit = ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
            if explicit or name not in values:
                values[name] = value
    return QuantConfig(**values)


@main.command(cls=_ConfigCommand)
@click.argument("model")
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Checkpoint folder to write.")
@click.option("--recipe", type=click.Path(), default=None,
              help="YAML/TOML file of options and per-module overrides (command-line options win).")
@click.option("--device", default="auto", help="Compute device: cpu, cuda, cuda:N or auto (GPU if available).")
@click.option("--dtype", default="auto",
              help="Source model dtype: auto (as stored; calibrated in fp32 on CPU: bf16 activations cost accuracy, "
                   "SmolLM2 w3 ppl 66.3 vs 64.8, and bf16 matmuls are slow on CPUs without avx512_bf16/AMX), "
                   "float32, float16 or bfloat16. Unquantized tensors are written in it.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it holds a checkpoint quantkit wrote, once the new one is complete. A folder with "
                   "other files, the source model folder or the current directory is never replaced.")
@click.option("--resume", is_flag=True,
              help="Continue the interrupted run of OUT (Ctrl-C, SIGTERM, SIGKILL, out of memory, a full disk) "
                   "after its last finished block: give the same command plus --resume. The result is byte-identical "
                   "to an uninterrupted run on the same device. Refused, naming what changed, when the settings, "
                   "device, versions, source model or calibration data differ. Without --resume an interrupted run "
                   "of OUT is an error (never silently deleted or reused): resume it, or delete its .OUT.tmp-PID "
                   "folder to start over.")
@click.option("--processes", type=click.IntRange(min=1), default=1,
              help="Spread calibration over N processes of this machine, started by quantkit (what torchrun "
                   "--nproc-per-node N does): with --device cuda process r runs on cuda:r (NCCL; choose the GPUs "
                   "with CUDA_VISIBLE_DEVICES), on the CPU they share its cores (gloo). Each process forwards its "
                   "share of the samples; the Hessians are summed, so the checkpoint is the single-process one up to "
                   "float summation order. "
                   "GPTQ-style methods; not awq, not with --resume; data-free methods run as one process.")
@click.pass_context
@click.option("--trust-remote-code", is_flag=True, help=TRUST_HELP)
def quantize(ctx, model, out, recipe, device, dtype, overwrite, resume, processes, trust_remote_code, **params):
    """Quantize MODEL (hub id or local folder) into the checkpoint folder OUT."""
    from quantkit.api import quantize as run
    from quantkit.calibration import distributed
    from quantkit.run.report import layer_table

    config = build_config(ctx, params, recipe)
    if processes > 1 and not config.needs_calibration:
        click.echo(f"note: --method {config.method} needs no calibration, which is what --processes spreads: running "
                   "as one process", err=True)
    elif processes > 1:
        ctx.exit(_launch(processes, model, out, config, device, overwrite, resume))
    elif config.needs_calibration and not distributed.under_torchrun():
        _mention_idle_gpus(device)
    report = run(model, out, config, device=device, dtype=dtype, overwrite=overwrite, resume=resume,
                 trust_remote_code=trust_remote_code)
    if report is not None:  # None: a torchrun process other than rank 0, which writes and reports
        click.echo(layer_table(report))
        click.echo(report["coverage"]["summary"])
        if "experts" in report:
            click.echo(report["experts"]["summary"])
        click.echo(f"wrote {out} ({len(report['layers'])} quantized linears, {report['seconds']:.1f} s)")
    if distributed.under_torchrun():
        distributed.leave_now()


def _launch(processes: int, model: str, out: str, config: QuantConfig, device: str, overwrite: bool,
            resume: bool) -> int:
    """quantize --processes N: this same command as N ranks (quantkit.calibration.distributed), checked before any starts."""
    from quantkit.calibration import distributed
    from quantkit.calibration.data import check_dataset
    from quantkit.models.hub import resolve_device
    from quantkit.run.output import check_output

    if distributed.under_torchrun():
        raise QuantkitError("--processes starts its own processes: under torchrun leave it out (torchrun's "
                            "--nproc-per-node sets the number)")
    distributed.check_supported(config, resume)
    distributed.check_shareable(config.nsamples, processes)
    check_dataset(config.dataset)  # each rank checks again; here it is one line, not N
    check_output(out, overwrite, sources=[model])  # rank 0 checks again; this saves starting N model loads
    argv = distributed.without_option(main.argv, "--processes")
    return distributed.launch_local(processes, argv, resolve_device(device))


def _mention_idle_gpus(device: str) -> None:
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        count = torch.cuda.device_count()
        click.echo(f"note: calibrating on cuda:0 alone while {count} GPUs are visible: --processes {count} spreads "
                   "the work over all of them", err=True)


@main.command()
@click.argument("src")
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Folder to write.")
@click.option("--checkpoint-format", type=click.Choice(write_formats()), required=True, help="The layout to write.")
@click.option("--max-shard-size", default=None,
              help="Largest safetensors shard (bytes, or with a unit as quantize takes it, e.g. 500MB). Default: the "
                   "one SRC was quantized with (its quantkit_recipe.yaml), else 4GB.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it holds a checkpoint quantkit wrote (never a folder with other files).")
def convert(src, out, checkpoint_format, max_shard_size, overwrite):
    """Repack the quantized folder SRC (gptq v1/v2, awq, compressed-tensors, quantkit integer layers) into OUT
    in another layout, exactly: codes, scales and zeros are decoded and re-encoded, never re-rounded. What the
    target cannot store (e.g. 3-bit as awq, a zero of 0 as gptq v1) is refused with the reason."""
    from quantkit.run.convert import convert as run

    report = run(src, out, checkpoint_format, overwrite, max_shard_size)
    click.echo(f"wrote {out} ({report['layers']} quantized linears, {report['source_format']} -> "
               f"{checkpoint_format})")


@main.group()
def eval():  # noqa: A001  (the command is called eval)
    """Evaluate a floating-point or quantized model."""


@eval.command()
@click.argument("path")
@click.option("--dataset", default="wikitext2", help=EVAL_DATASET_HELP)
@click.option("--seqlen", type=int, default=512,
              help="Tokens per non-overlapping window, at most the model's context (max_position_embeddings).")
@click.option("--max-tokens", type=int, default=None, help="Evaluate only the first T tokens (default: all).")
@click.option("--device", default="auto", help="cpu, cuda, cuda:N or auto.")
@click.option("--dtype", default=None, help=ACTIVATION_DTYPE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (ppl, nll, tokens, windows, seqlen).")
@click.option("--stream", is_flag=True, help=STREAM_HELP)
@click.option("--trust-remote-code", is_flag=True, help=TRUST_HELP)
def perplexity(path, dataset, seqlen, max_tokens, device, dtype, as_json, stream, trust_remote_code):
    """Perplexity of PATH (a model folder/hub id, or a quantized folder) with the standard protocol."""
    from quantkit.eval import evaluate_path

    result = evaluate_path(path, dataset, seqlen, max_tokens, device, dtype, progress=not as_json, stream=stream,
                           trust_remote_code=trust_remote_code)
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"perplexity {result['ppl']:.4f} over {result['tokens']} tokens "
                   f"({result['windows']} windows of {seqlen}) on {dataset}")


@eval.command()
@click.argument("quant")
@click.option("--base", default=None,
              help="The floating-point model QUANT was made from (folder or hub id). Default: the source QUANT's "
                   "quantkit_report.json names (quantkit quantize records it).")
@click.option("--dataset", default="wikitext2", help=EVAL_DATASET_HELP)
@click.option("--seqlen", type=int, default=512,
              help="Tokens per non-overlapping window, at most the model's context (max_position_embeddings).")
@click.option("--max-tokens", type=int, default=None, help="Compare on the first T tokens only (default: all).")
@click.option("--device", default="auto", help="cpu, cuda, cuda:N or auto.")
@click.option("--dtype", default=None, help=ACTIVATION_DTYPE_HELP)
@click.option("--low-memory", is_flag=True,
              help="Hold one model at a time: the base model's fp32 log-probs are cached on disk "
                   "(tokens x vocab x 4 bytes) and read back while the quantized model runs. Same numbers.")
@click.option("--cache-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Where --low-memory puts its temporary cache (default: the system temp folder).")
@click.option("--prompts", default=None,
              help="A text file (one prompt per line) or a prompt: greedy continuations of both models side by "
                   "side, the first diverging token marked.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, help="Tokens generated per prompt.")
@click.option("--json", "as_json", is_flag=True,
              help='Print one JSON object: tokens, windows, seqlen, ppl {base, quant, delta}, kld {mean, stderr, '
                   'median, p90, p99, p999, max}, top1 {mean, stderr}, delta_p {mean, stderr}, generations.')
@click.option("--stream", is_flag=True, help=STREAM_HELP + " With --low-memory, for two models larger than RAM.")
@click.option("--trust-remote-code", is_flag=True, help=TRUST_HELP)
def compare(quant, base, dataset, seqlen, max_tokens, device, dtype, low_memory, cache_dir, prompts, max_new_tokens,
            as_json, stream, trust_remote_code):
    """QUANT against its base model on the same windows: ppl of each, KL divergence, top-1 agreement, Δp."""
    from quantkit.compare import compare_paths, read_prompts, recorded_base, report_text

    base = base or recorded_base(quant)
    result = compare_paths(quant, base, dataset, seqlen, max_tokens, device, dtype, low_memory, cache_dir,
                           read_prompts(prompts) if prompts else (), max_new_tokens, progress=not as_json,
                           stream=stream, trust_remote_code=trust_remote_code)
    click.echo(json.dumps(result) if as_json else report_text(result, quant, base, dataset))


@main.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def inspect(path, as_json):
    """Per-layer method, bits, group size, bits per weight and total size of a quantized folder."""
    from quantkit.run.report import inspect_checkpoint, inspect_table

    info = inspect_checkpoint(path)
    click.echo(json.dumps(info, indent=2) if as_json else inspect_table(info))


@main.command()
@click.option("-o", "--output", "out", type=click.Path(), default=None,
              help="Keep the quantized checkpoint here (default: a temporary folder, deleted afterwards).")
@click.option("--bits", type=int, default=4, help="Bits per weight.")
@click.option("--group-size", type=int, default=32, help="Group size (the bundled model is 64 wide).")
@click.option("--method", type=click.Choice(method_names()), default="rtn", help="Quantization method.")
@click.option("--tokens", type=click.IntRange(min=512), default=16384,
              help="Self-generated evaluation/calibration tokens (at least one 512-token window).")
@click.option("--overwrite", is_flag=True,
              help="Replace -o if it holds a checkpoint quantkit wrote (never a folder with other files).")
def demo(out, bits, group_size, method, tokens, overwrite):
    """Quantize the bundled tiny Llama (stories260k) offline and print fp vs quantized perplexity."""
    from quantkit.demo import run_demo

    click.echo(run_demo(out, bits, group_size, method, tokens, overwrite))


if __name__ == "__main__":
    sys.exit(main())
