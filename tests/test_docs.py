"""The documents' commands: the Chinese quick start's are the English ones, byte for byte."""
import re

from conftest import REPO


def bash_lines(path):
    """The lines of a file's ```bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()
            if line.strip()]


def test_every_command_of_the_chinese_quick_start_is_in_the_english_docs():
    english = "\n".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    english = english.replace("\\\n", " ")
    lines = bash_lines(REPO / "README.zh-CN.md")
    assert len(lines) >= 10
    missing = [line for line in lines if line not in english]
    assert not missing, missing


def test_every_document_linked_from_the_readmes_exists():
    for readme in ("README.md", "README.zh-CN.md"):
        for target in re.findall(r"\]\(([^)#]+)\)", (REPO / readme).read_text()):
            if "://" not in target:
                assert (REPO / target).exists(), f"{readme} links to {target}, which is missing"
