"""The pictures of docs/tensor_parallel.md: one transformer block cut over t = 2 tensor-parallel ranks.

Launch:  python benchmarks/tensor_parallel_pictures.py [--out docs/images]
(python docs/generate.py runs it too: PICTURES there names both pictures)

    tensor_parallel_block.svg     Megatron-LM's split block (Shoeybi et al. 2019, arXiv 1909.08053,
                                  §3): f before each column-parallel linear, g after each
                                  row-parallel one; everything else whole on every rank
    sequence_parallel_block.svg   the same block with sequence parallelism (Korthikanti et al. 2022,
                                  arXiv 2205.05198, §4.2.2): f̄ all-gathers, ḡ reduce-scatters, and the
                                  layer norms, dropouts and residual adds run on sequence shards

Each picture is one column per rank of the group, time running downwards, one box per step of
the block as refimpl runs it (refimpl/parallel/tensor_parallel/gpt.py, layers.py, operators.py),
coloured by what the rank holds: the whole activation (the same on every rank), its slice of the
heads or columns, or its sequence shard; an orange bar is a collective over the group. The SVG is
written as text, like the schedule pictures (refimpl/tools/render.py): no matplotlib,
integer coordinates only, so the files are the same on every machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[1]

FILL = {"whole": "#e3e3e3", "split": "#8fb9e8", "shard": "#9fd8a4", "comm": "#f4c27a"}
LEGEND = {"whole": "whole (B, T, C): the same on every rank",
          "split": "this rank's heads or columns",
          "shard": "this rank's sequence shard (B, T/2, C)",
          "comm": "collective over the tp group"}

WIDTH = 800
LANES = (44, 436)  # left edge of rank 0's and rank 1's column
LANE_WIDTH = 340
BOX, BAR, GAP = 36, 26, 14  # heights of a step's box and of a collective's bar; the arrow between rows
TOP = 70


def _rows(sequence_parallel: bool) -> list:
    """The block's steps, top to bottom: ("lanes", kind, [(title, detail) of rank 0, of rank 1]) or
    ("bar", title, detail); a "residual" key marks where a residual starts and where it is added."""
    if sequence_parallel:
        act = "shard"
        rows_of = ("rows 0…T/2−1", "rows T/2…T−1")
        shape = "(B, T/2, C)"
        f = ("f̄", "forward: all-gather the shards → (B, T, C)  ·  backward: reduce-scatter dx")
        g = ("ḡ", "forward: reduce-scatter the partial sums → (B, T/2, C)  ·  backward: all-gather")
        start = [(f"x: {rows}", f"{shape}, this rank's part of the sequence") for rows in rows_of]
    else:
        act = "whole"
        shape = "(B, T, C)"
        f = ("f", "forward: identity  ·  backward: all-reduce dx (B, T, C)")
        g = ("g", "forward: all-reduce the partial sums (B, T, C)  ·  backward: identity")
        start = [("x", f"{shape}, the same on both ranks")] * 2
    heads = ("0…H/2−1", "H/2…H−1")
    columns = ("0…2C−1", "2C…4C−1")
    return [
        ("lanes", act, start, "from"),
        ("lanes", act, [("ln1", shape)] * 2),
        ("bar",) + f,
        ("lanes", "split", [("qkv: column-parallel", f"rows of heads {h} of q, k and v → (B, T, 3C/2)")
                            for h in heads]),
        ("lanes", "split", [("attention core", f"heads {h}: softmax (B, H/2, T, T), dropout, · v") for h in heads]),
        ("lanes", "split", [("proj: row-parallel", f"columns of heads {h} → a partial sum (B, T, C)")
                            for h in heads]),
        ("bar",) + g,
        ("lanes", act, [("+ proj bias, dropout, + residual", shape)] * 2, "to", "from"),
        ("lanes", act, [("ln2", shape)] * 2),
        ("bar",) + f,
        ("lanes", "split", [("fc: column-parallel, GeLU", f"rows {c} of 4C → (B, T, 2C)") for c in columns]),
        ("lanes", "split", [("proj: row-parallel", f"columns {c} → a partial sum (B, T, C)") for c in columns]),
        ("bar",) + g,
        ("lanes", act, [("+ proj bias, dropout, + residual", f"{shape} → the next block")] * 2, "to"),
    ]


def _height(row) -> int:
    return BAR if row[0] == "bar" else BOX


def svg(name: str) -> str:
    """The SVG text of docs/images/NAME.svg (tensor_parallel_block or sequence_parallel_block)."""
    if name not in PICTURES:
        raise ValueError(f"unknown picture {name!r}; choose one of {', '.join(PICTURES)}")
    sequence_parallel = name == "sequence_parallel_block"
    rows = _rows(sequence_parallel)
    tops, y = [], TOP
    for row in rows:
        tops.append(y)
        y += _height(row) + GAP
    notes = [
        "Between f̄ and ḡ the activations are split by heads or columns, as without sequence parallelism."
        if sequence_parallel else
        "Between f and g nothing is communicated: a column-parallel linear feeds a row-parallel one.",
        "The column-parallel linears keep only their input's shard (B, T/2, C) and all-gather it again in backward."
        if sequence_parallel else
        "Per block: 2 all-reduces of (B, T, C) in forward (g), 2 in backward (f).",
        "ln1, ln2 and the proj biases see only this rank's rows: a hook all-reduces their gradients."
        if sequence_parallel else
        "ln1, ln2, the proj biases and the dropouts outside the core compute the same on both ranks.",
    ]
    legend_top = y + 4
    height = legend_top + 26 + 16 * len(notes) + 14
    lanes_end = LANES[1] + LANE_WIDTH
    title = ("One transformer block with sequence parallelism, t = 2 (Korthikanti et al. 2022)" if sequence_parallel
             else "One transformer block cut over t = 2 tensor-parallel ranks (Megatron-LM)")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'font-family="sans-serif" font-size="11">',
        f"<title>{name}: {escape(title)}; generated by benchmarks/tensor_parallel_pictures.py</title>",
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>',
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LANES[0]}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for lane, label in zip(LANES, ("rank 0 of the group (t = 0)", "rank 1 of the group (t = 1)")):
        out.append(f'<text x="{lane + LANE_WIDTH // 2}" y="52" text-anchor="middle" font-weight="bold">{label}</text>')
    # arrows between consecutive rows, down each rank's column
    for i in range(len(rows) - 1):
        for lane in LANES:
            x = lane + LANE_WIDTH // 2
            out.append(f'<line x1="{x}" y1="{tops[i] + _height(rows[i])}" x2="{x}" y2="{tops[i + 1] - 1}" '
                       f'stroke="#555" stroke-width="1.2" marker-end="url(#arrow)"/>')
    # residual connections, left of each column: from the block input to the first add, then to the second
    marks = [(i, row[3:]) for i, row in enumerate(rows) if row[0] == "lanes" and len(row) > 3]
    froms = [i for i, m in marks if "from" in m]
    tos = [i for i, m in marks if "to" in m]
    for a, b in zip(froms, tos):
        for lane in LANES:
            x, y0, y1 = lane - 16, tops[a] + BOX // 2, tops[b] + BOX // 2
            out.append(f'<path d="M{lane},{y0} L{x},{y0} L{x},{y1} L{lane - 1},{y1}" fill="none" stroke="#777" '
                       f'stroke-width="1.2" stroke-dasharray="4,3" marker-end="url(#arrow)"/>')
    for row, top in zip(rows, tops):
        if row[0] == "bar":
            _, symbol, detail = row
            out.append(f'<rect x="{LANES[0]}" y="{top}" width="{lanes_end - LANES[0]}" height="{BAR}" rx="4" '
                       f'fill="{FILL["comm"]}" stroke="#333" stroke-width="0.8"/>')
            out.append(f'<text x="{LANES[0] + 12}" y="{top + 18}" font-size="15" font-weight="bold" '
                       f'font-style="italic">{escape(symbol)}</text>')
            out.append(f'<text x="{(LANES[0] + lanes_end) // 2}" y="{top + 17}" text-anchor="middle">'
                       f"{escape(detail)}</text>")
            continue
        kind, texts = row[1], row[2]
        for lane, (head, detail) in zip(LANES, texts):
            out.append(f'<rect x="{lane}" y="{top}" width="{LANE_WIDTH}" height="{BOX}" rx="3" fill="{FILL[kind]}" '
                       f'stroke="#333" stroke-width="0.8"/>')
            out.append(f'<text x="{lane + 8}" y="{top + 14}" font-weight="bold">{escape(head)}</text>')
            out.append(f'<text x="{lane + 8}" y="{top + 29}" font-size="10">{escape(detail)}</text>')
    kinds = ["whole", "split", "comm"] if not sequence_parallel else ["shard", "split", "comm"]
    x = LANES[0]
    for kind in kinds:
        out.append(f'<rect x="{x}" y="{legend_top}" width="14" height="14" fill="{FILL[kind]}" stroke="#333" '
                   f'stroke-width="0.8"/>')
        out.append(f'<text x="{x + 20}" y="{legend_top + 11}">{escape(LEGEND[kind])}</text>')
        x += 250
    for i, note in enumerate(notes):
        out.append(f'<text x="{LANES[0]}" y="{legend_top + 36 + 16 * i}">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


PICTURES = ("tensor_parallel_block", "sequence_parallel_block")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="folder for the SVG files")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in PICTURES:
        (args.out / f"{name}.svg").write_text(svg(name))
        print(f"wrote {args.out / f'{name}.svg'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
