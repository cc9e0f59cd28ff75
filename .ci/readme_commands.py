"""Print one of the README's two commands exactly as the README writes it.

    python3 .ci/readme_commands.py run|test

The commands are the ```bash blocks of the README's "## Two commands" section: the
first is the run command, the second the test command. CI runs what it prints, so an
edit to either command in the README is what CI checks next.
"""

import re
import sys
from pathlib import Path

readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
section = re.search(r"^## Two commands\n(.*?)(?=^## )", readme, re.S | re.M)
if section is None:
    sys.exit("README.md has no '## Two commands' section")
blocks = re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M)
if len(blocks) != 2:
    sys.exit(f"README.md's '## Two commands' has {len(blocks)} bash blocks, not 2 (run, test)")
print(blocks[{"run": 0, "test": 1}[sys.argv[1]]].strip())
