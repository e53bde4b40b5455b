"""The README's options table names every field of `AInferPDConfig`, with its default and, for an
option with a fixed set of values, every value."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from vllm_ainfer_pd import config
from vllm_ainfer_pd.config import AInferPDConfig

README = Path(__file__).resolve().parents[1] / "README.md"
HEADER = "| option | values (default) | meaning |"
CHOICES = {"mode": config.MODES, "ordering": config.ORDERINGS,
           "segment_policy": config.SEGMENT_POLICIES, "rendezvous": config.RENDEZVOUS,
           "p_host": config.P_HOSTS, "d_stream_priority": config.D_STREAM_PRIORITIES,
           "p_stream_marks": config.P_STREAM_MARKS}


def options_table(text: str) -> dict[str, tuple[str, str]]:
    """option -> (its values cell, its default as written), from the table under `HEADER`; a row
    may name several options, with one default each: "(`load`, 1)"."""
    lines = text.splitlines()
    start = lines.index(HEADER) + 2  # past the header and its |---| line
    out = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names_cell, values_cell = (c.strip() for c in line.strip("|").split("|")[:2])
        names = re.findall(r"`([^`]+)`", names_cell)
        defaults = re.search(r"\(([^()]*)\)\s*$", values_cell)
        assert defaults, f"no (default) at the end of {values_cell!r}"
        parts = [d.strip().strip("`") for d in defaults.group(1).split(",")]
        assert len(parts) == len(names), f"{names}: defaults {parts}"
        out.update({n: (values_cell, d) for n, d in zip(names, parts, strict=True)})
    return out


def written(default: object) -> str:
    if default is None:  # unset: chosen by layout, which the meaning cell says
        return "unset"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def test_readme_options_table_matches_the_config_fields_defaults_and_values():
    table = options_table(README.read_text())
    fields = {f.name: f.default for f in dataclasses.fields(AInferPDConfig)}
    assert sorted(table) == sorted(fields)
    for name, default in fields.items():
        values, shown = table[name]
        assert shown == written(default), f"{name}: README says ({shown}), config {default!r}"
        for value in CHOICES.get(name, ()):
            assert f"`{value}`" in values, f"{name}: README omits the value {value!r}"


def test_the_table_check_notices_a_missing_option():
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `p_deepep_sms` |"))
    assert "p_deepep_sms" not in options_table(text.replace(row + "\n", ""))
