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
