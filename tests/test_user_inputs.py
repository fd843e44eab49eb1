"""Every path from a user's input to an exception ends in one `error:` line naming the input and the fix (issue 41):
files that are folders, missing, not UTF-8; values out of range; report files of the wrong shape."""
import json

import pytest
from test_validation import assert_user_error, run

from quantkit.core.errors import QuantkitError
from quantkit.demo import bundled_model_path

NOT_UTF8 = b"bits: 4\n\xff\xfe caf\xe9\n"


@pytest.fixture
def quantized(tmp_path_factory):
    out = tmp_path_factory.mktemp("user-inputs") / "q"
    assert run("quantize", bundled_model_path(), "-o", out, "--method", "rtn", "--group-size", 32).exit_code == 0
    return out


def quantize(tmp_path, *extra):
    return run("quantize", bundled_model_path(), "-o", tmp_path / "q", "--method", "rtn", "--group-size", 32, *extra)


@pytest.mark.parametrize("make,words", [
    (lambda p: p.mkdir(), ["is a folder, not a file"]),
    (lambda p: None, ["not found"]),
    (lambda p: p.write_bytes(NOT_UTF8), ["not UTF-8"]),
])
def test_a_recipe_that_is_no_readable_text_file(tmp_path, make, words):
    recipe = tmp_path / "recipe.yaml"
    make(recipe)
    assert_user_error(quantize(tmp_path, "--recipe", recipe), str(recipe), *words)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("seed", [-1, 2**31, 2**70])
def test_seeds_that_would_alias_a_smaller_one_are_refused(tmp_path, seed):
    assert_user_error(quantize(tmp_path, "--seed", seed), f"--seed {seed}", "0 to 2147483647")


def test_inspect_of_a_file_says_it_is_a_file(quantized):
    assert_user_error(run("inspect", quantized / "config.json"), "is a file, not a quantized model folder")


@pytest.mark.parametrize("make,words", [
    (lambda p: None, ["--prompts file", "not found"]),
    (lambda p: p.mkdir(), ["is a folder, not a file"]),
    (lambda p: p.write_bytes(NOT_UTF8), ["not UTF-8"]),
])
def test_prompts_that_look_like_a_file_but_are_none(quantized, tmp_path, make, words):
    prompts = tmp_path / "my_prompts.txt"
    make(prompts)
    result = run("eval", "compare", quantized, "--base", bundled_model_path(), "--prompts", prompts, "--max-tokens",
                 64, "--seqlen", 32)
    assert_user_error(result, *words)


def test_a_prompt_of_words_is_still_a_prompt():
    from quantkit.compare import read_prompts

    assert read_prompts("Once upon a time") == ["Once upon a time"]
    assert read_prompts("What is 3/4 of 8?") == ["What is 3/4 of 8?"]


@pytest.mark.parametrize("edit,words", [
    (lambda r: r.update(layers=[]), ["'layers' should be an object or a count, not []"]),
    (lambda r: r.update(model=7), ["'model' should be a string, not 7"]),
    (lambda r: next(iter(r["layers"].values())).update(error="big"), ["is not an object of numbers"]),
])
@pytest.mark.parametrize("command", ["inspect", "compare"])
def test_a_report_of_the_wrong_shape_is_one_line(quantized, edit, words, command):
    path = quantized / "quantkit_report.json"
    report = json.loads(path.read_text())
    edit(report)
    path.write_text(json.dumps(report))
    argv = ["inspect", quantized] if command == "inspect" else ["eval", "compare", quantized, "--max-tokens", 64]
    assert_user_error(run(*argv), "quantkit_report.json is damaged", *words, "delete it")


@pytest.fixture
def damaged_tokenizer(tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(bundled_model_path(), src)
    (src / "tokenizer.json").write_text('{"a": 1}')  # valid JSON the tokenizer library fails on (KeyError)
    return src


def test_a_damaged_tokenizer_is_one_line_where_text_is_needed(damaged_tokenizer, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("Once upon a time there was a cat. " * 200)
    result = run("quantize", damaged_tokenizer, "-o", tmp_path / "q", "--method", "gptq", "--dataset", text,
                 "--nsamples", 2, "--seqlen", 32, "--group-size", 32)
    assert_user_error(result, "no tokenizer could be loaded", "tokenizer files")


def test_a_data_free_method_needs_no_tokenizer(damaged_tokenizer, tmp_path):
    result = run("quantize", damaged_tokenizer, "-o", tmp_path / "q", "--method", "rtn", "--group-size", 32)
    assert result.exit_code == 0, result.output
    assert "this method needs no text" in result.output and not (tmp_path / "q" / "tokenizer.json").exists()


def test_ctrl_c_while_the_cli_is_imported_is_aborted_not_a_traceback(monkeypatch, capsys):
    import sys

    import quantkit

    class Interrupting:
        def find_spec(self, name, path=None, target=None):
            if name == "quantkit.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "quantkit.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    with pytest.raises(SystemExit) as stop:
        quantkit.command_line()
    assert stop.value.code == 1 and "Aborted!" in capsys.readouterr().err


@pytest.mark.parametrize("name,words", [
    ("a" * 250, ["250 bytes", "choose a shorter name"]),
    ("/".join(["b" * 200] * 25), ["longer than the file systems take (4096)"]),
    ("q\udcff", ["not UTF-8"]),
])
def test_output_names_the_file_system_would_refuse_are_refused_at_once(tmp_path, name, words):
    result = run("quantize", bundled_model_path(), "-o", f"{tmp_path}/{name}", "--method", "rtn")
    assert_user_error(result, *words)
    assert list(tmp_path.iterdir()) == []


def test_calibration_that_cannot_fit_or_is_not_text_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from quantkit.run import pipeline

    monkeypatch.setattr(pipeline, "open_model", lambda *a, **k: pytest.fail("the model was opened"))
    text = tmp_path / "calib.txt"
    text.write_text("Once upon a time. " * 100)
    huge = quantize(tmp_path, "--method", "gptq", "--dataset", text, "--nsamples", 100_000_000)
    assert_user_error(huge, "the calibration activations need", "GiB", "fewer --nsamples")
    for content, words in ((b"", ["is empty"]), (b"\x7fELF\x00\x01", ["is binary, not text"]),
                           (b"caf\xe9 au lait", ["not UTF-8"])):
        text.write_bytes(content)
        assert_user_error(quantize(tmp_path, "--method", "gptq", "--dataset", text), str(text), *words)


def test_a_cache_folder_that_takes_no_file_is_refused_before_the_models_load(quantized, tmp_path, monkeypatch):
    import errno
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryDirectory", refuse)
    result = run("eval", "compare", quantized, "--base", bundled_model_path(), "--low-memory", "--cache-dir", tmp_path,
                 "--max-tokens", 64)
    assert_user_error(result, f"--cache-dir {tmp_path}", "Permission denied", "folder you can write to")


def test_a_config_of_another_architecture_is_named_as_such(tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(bundled_model_path(), src)
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (src / "config.json").write_text(json.dumps(config))
    result = run("quantize", src, "-o", tmp_path / "q", "--method", "rtn")
    assert_user_error(result, "config.json does not describe its weights", "belongs to another model")


def _hostile_values(tmp_path):
    folder, file = tmp_path / "a-folder", tmp_path / "a-file.txt"
    folder.mkdir(exist_ok=True)
    file.write_text("text")
    return ["", "-1", "0", "9" * 30, "nan", "q\udcff", str(folder), str(file), "x" * 5000]


def _commands():
    """(argv before the options, the command) of every command; MODEL / IN / PATH never exist, so that a value an
    option takes leads to the model's own error instead of a run."""
    from quantkit.cli import main

    missing = "/nonexistent-quantkit-model"
    return [(["quantize", missing, "-o", "OUT"], main.commands["quantize"]),
            (["convert", missing, "-o", "OUT", "--checkpoint-format", "gptq"], main.commands["convert"]),
            (["eval", "perplexity", missing], main.commands["eval"].commands["perplexity"]),
            (["eval", "compare", missing, "--base", missing], main.commands["eval"].commands["compare"]),
            (["inspect", missing], main.commands["inspect"]),
            (["demo", "-o", "OUT"], main.commands["demo"])]


def test_every_option_given_a_hostile_value_is_one_error_line(tmp_path, monkeypatch):
    """Each option of each command, in turn, given an empty, negative, zero, huge, NaN, non-UTF-8, folder, file or
    5,000-character value: exit code 2, one error line (quantkit's `error:` or click's `Error:` for a value of the
    wrong type), no traceback, and nothing written anywhere."""
    import click
    from click.testing import CliRunner

    from quantkit import demo
    from quantkit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "bundled_model_path", lambda: tmp_path / "no-bundled-model")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a value read as a hub id: no retries
    values = _hostile_values(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    tried, failures = 0, []
    for head, command in _commands():
        for option in command.get_params(click.Context(command)):  # quantize builds its run settings there
            if not isinstance(option, click.Option) or option.is_flag or option.name == "help":
                continue
            for value in values:
                argv = [a if a != "OUT" else str(tmp_path / "out") for a in head]
                if option.opts[0] in argv:  # a value of an option the head gives: replace it
                    argv[argv.index(option.opts[0]) + 1] = value
                else:
                    argv += [option.opts[0], value]
                result = CliRunner().invoke(main, argv)
                tried += 1
                lines = [line for line in result.output.splitlines() if line.startswith(("error: ", "Error: "))]
                if result.exit_code != 2 or "Traceback" in result.output or len(lines) != 1 or not (
                        result.exception is None or isinstance(result.exception, SystemExit)):
                    failures.append(f"{' '.join(head[:2])} {option.opts[0]} {value[:20]!r}: exit {result.exit_code}, "
                                    f"{result.exception!r} {result.output[-300:]}")
    assert not failures, "\n".join(failures)
    assert tried > 300 and sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_small_sizes_never_read_zero_and_dtype_refusals_name_the_option():
    from quantkit.core.units import size_text

    from quantkit.models.hub import parse_dtype

    assert size_text(48_000) == "46.9 KiB" and size_text(5 * 2**20) == "5.0 MiB" and size_text(3 * 2**30) == "3.00 GiB"
    with pytest.raises(QuantkitError, match="--dtype 'float64' is not a dtype quantkit computes in"):
        parse_dtype("float64")
