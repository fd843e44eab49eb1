"""The README's Python API example runs as written, offline."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


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
