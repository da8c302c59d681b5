"""Every README and docs/ example that trains a preset model fits an 80 GB H100 by the dry run, with the
flags as shown (the SLURM script's ``--dp-shard -1`` is the world its #SBATCH lines ask for)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from click.testing import CliRunner

from shardsmith.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
#: The front page and every guide: an example moved into docs/ stays checked.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Flags that matter to a real run but not to the dry run's memory (the dry run refuses none of them).
_RUN_ONLY = {
    "--ckpt": 1,
    "--resume": 1,
    "--steps": 1,
    "--save-interval": 1,
    "--async-save": 0,
    "--dry-run": 0,
    "--gpu": 1,
    "--gpu-memory": 1,
    "--json": 0,
}


def readme_train_examples() -> list[tuple[list[str], int | None]]:
    """(train flags, world size or None) of each README command that trains a ``--model`` preset."""
    text = "\n".join(d.read_text() for d in DOCUMENTS)
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        nodes = re.search(r"#SBATCH --nodes=(\d+)", joined)
        for line in joined.splitlines():
            if "shardsmith train" not in line or "--model" not in line:
                continue
            words = shlex.split(line.split("shardsmith train", 1)[1].split("#")[0])
            flags, i = [], 0
            while i < len(words):
                if words[i] in _RUN_ONLY:
                    i += 1 + _RUN_ONLY[words[i]]
                    continue
                flags.append(words[i])
                i += 1
            world = None
            if nodes:
                per_node = re.search(r"--nproc-per-node (\d+)", joined)
                world = int(nodes.group(1)) * int(per_node.group(1))
            out.append((flags, world))
    return out


def _with_world(flags: list[str], world: int | None) -> list[str]:
    if world is None or "-1" not in flags:
        return flags
    f = list(flags)
    tp = int(f[f.index("--tp") + 1]) if "--tp" in f else 1
    pp = int(f[f.index("--pp") + 1]) if "--pp" in f else 1
    f[f.index("-1")] = str(world // (tp * pp))
    return f


def test_readme_preset_examples_fit_an_h100() -> None:
    examples = readme_train_examples()
    names = [" ".join(f) for f, _ in examples]
    assert any("llama3-70b" in n and "--virtual-stages 8" in n for n in names), (
        names
    )  # the SLURM script
    assert sum("llama3-70b" in n for n in names) >= 3 and any(
        "llama3.1-405b" in n for n in names
    ), names
    for flags, world in examples:
        args = ["train", *_with_world(flags, world), "--dry-run", "--gpu", "h100", "--json"]
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 0, (args, out.output[-2000:])
        report = json.loads(out.output)
        assert report["fits"] is True, (
            args,
            [(g.get("stage"), g.get("headroom_bytes")) for g in report.get("rank_groups", [])],
        )
