"""The README's Python API example runs as written, offline; its demo output is the demo's; every `quantkit` command
it shows parses (options and values the CLI knows); the plot's data file holds only numbers that docs/QUALITY.md
shows."""
import json
import re
import shlex
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_api_example_runs_offline(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    exec(compile(code, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "'bits': 4" in printed and "Once upon a time" in printed
    assert (tmp_path / "stories-w4" / "model.safetensors").is_file()
    # the second half loads a quantkit-format folder through transformers' AutoModelForCausalLM
    config = json.loads((tmp_path / "stories-tq4" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "quantkit"
    assert printed.count("Once upon a time") == 2


def test_the_demo_prints_the_table_the_readme_shows(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from quantkit.cli import main

    monkeypatch.chdir(tmp_path)
    text = README.read_text()
    shown = re.search(r"```\n(warning: .*?)```", text[text.index("## The two commands"):], re.S).group(1)
    table = [line for line in shown.splitlines() if line.startswith("|")]
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    assert table and all(line in result.output.splitlines() for line in table), result.output


def _readme_commands():
    """Every line of the README's bash blocks that runs quantkit, as shlex splits it (comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.startswith("quantkit ")]


def test_the_readme_shows_a_command_for_each_thing_people_do():
    shown = {" ".join(words[:3]) if words[1] == "eval" else " ".join(words[:2]) for words in _readme_commands()}
    assert {"quantkit demo", "quantkit quantize", "quantkit eval perplexity", "quantkit eval compare",
            "quantkit convert", "quantkit inspect"} <= shown
    assert any("--gguf-type" in words for words in _readme_commands())


@pytest.mark.parametrize("words", _readme_commands(), ids=lambda words: " ".join(words[:3]))
def test_every_quantkit_command_in_the_readme_parses(words):
    """Parsed by the CLI itself (its options, choices and types), not run: the README's models are hub ids."""
    from quantkit.cli import main

    command, args, ctx, name = main, words[1:], None, "quantkit"
    while isinstance(command, click.Group):
        # with the group's settings, as click builds it: a context without them would make click cache a help
        # option of "--help" alone on the command (no -h), and later renderings of its help (CLI.md) would differ
        ctx = click.Context(command, info_name=name, parent=ctx, **command.context_settings)
        name, args = args[0], args[1:]
        command = command.get_command(ctx, name)
        assert command is not None, f"no command {name!r}: {' '.join(words)}"
    command.make_context(name, args, parent=ctx)  # raises click's UsageError / BadParameter on a wrong option


def test_every_number_the_plot_draws_is_one_quality_md_shows():
    data = json.loads((ROOT / "docs" / "quality_smollm2.json").read_text())
    quality = (ROOT / "docs" / "QUALITY.md").read_text()
    derived = {("llm-compressor", "bpw", 4.3125)}  # bits + (16 + bits) / 64, explained in the set's bpw_note
    missing = []
    for s in data["sets"]:
        for row in s["rows"]:
            for key in ("bpw", "ppl", "kld", "top1", "mib"):
                if key not in row or (s["id"], key, row[key]) in derived:
                    continue
                # the number as QUALITY.md writes it: JSON drops trailing zeros (37.670 -> 37.67)
                if not re.search(rf"(?<![\d.]){re.escape(repr(row[key]))}0*(?!\d)", quality):
                    missing.append(f"{s['id']} {row.get('run') or row.get('type')} {key} {row[key]}")
    assert not missing, "numbers in docs/quality_smollm2.json that docs/QUALITY.md does not show: " + ", ".join(missing)
