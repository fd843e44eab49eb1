"""docs/CLI.md is what scripts/cli_reference.py renders from the click commands now, byte for byte."""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import cli_reference  # noqa: E402


def test_docs_cli_md_is_up_to_date():
    written = cli_reference.DOC.read_text(encoding="utf-8")
    rendered = cli_reference.render()
    if written == rendered:
        return
    recorded = re.search(r"\(click ([^)]+)\)", written.splitlines()[0])
    if recorded and recorded.group(1) != cli_reference.click_version():
        pytest.skip(f"docs/CLI.md was rendered with click {recorded.group(1)}, this is click "
                    f"{cli_reference.click_version()}: its formatter wraps differently, so the two cannot be compared")
    pytest.fail(f"docs/CLI.md is stale (the CLI's commands or help texts changed): run `{cli_reference.COMMAND}` "
                "and commit docs/CLI.md")


def test_every_command_path_has_its_section():
    from quantkit.cli import main

    headings = re.findall(r"^## `(.*)`$", cli_reference.render(), re.M)
    assert headings[0] == "quantkit"
    for name, command in main.commands.items():
        assert f"quantkit {name}" in headings
        for sub in getattr(command, "commands", {}):
            assert f"quantkit {name} {sub}" in headings
    assert "quantkit eval perplexity" in headings and "quantkit eval compare" in headings
