"""The FP8 policy of a build (`slmrank build --fp8`, issue 29) as text: which linear layers are
float8_e4m3fn, and each part's row floor, below which a GEMM runs on the part's model-dtype copy
(service/model/checkpoint.py: NAME.full, NAME.min_rows). No torch here: the client shows it too."""

from __future__ import annotations

FP8_PARTS = ("mlp", "attn", "head")  # `slmrank build --fp8`: which linear layers are e4m3


def parse_fp8_policy(value: str, flag: str = "--fp8") -> tuple[tuple[str, ...], dict[str, int]]:
    """none | PART[:ROWS][,PART[:ROWS]...] (parts of FP8_PARTS) -> (the parts, their row floors); a
    ValueError naming the flag otherwise."""
    if value == "none":
        return (), {}
    parts: list[str] = []
    floors: dict[str, int] = {}
    for item in value.split(","):
        part, colon, rows = item.partition(":")
        if part not in FP8_PARTS:
            raise ValueError(f"{flag} {value!r}: {part!r} is not one of {', '.join(FP8_PARTS)} (comma-separated, "
                             "each with an optional :ROWS), or none")
        if part in parts:
            raise ValueError(f"{flag} {value!r}: {part!r} given twice")
        if colon:
            if not rows.isdigit() or int(rows) < 1:
                raise ValueError(f"{flag} {value!r}: {item!r}: ROWS must be an integer >= 1 (the fewest activation "
                                 "rows a GEMM of the part runs in FP8 with)")
            floors[part] = int(rows)
        parts.append(part)
    return tuple(parts), floors


def fp8_text(parts: tuple[str, ...] | list[str], floors: dict[str, int]) -> str:
    """The policy as --fp8 takes it, e.g. 'mlp:2048,attn:2048,head'."""
    return ",".join(f"{p}:{floors[p]}" if p in floors else p for p in parts)
