"""`slmrank serve` with some of the scheduler's internal constants changed: for measuring a batching
or admission policy before it becomes a default (they are no flags on purpose: settings.py).

    python -m ops.bench.serve_tuned --set batcher.load_wait_share=0.5 --set batcher.load_wait_max_s=0.008 \
        -- --model embedded:qwen2.5-0.5b --port 50079

`--set SECTION.FIELD=VALUE` (SECTION: batcher = BatcherConfig, admission = AdmissionConfig) replaces
that dataclass field's default before the server builds its config; VALUE is parsed as the
default's type. Everything after `--` goes to `slmrank serve` unchanged. A field that does not
exist, or a value of the wrong type, ends in one line and exit 2 (nothing is served).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from service.sched.admission import AdmissionConfig
from service.sched.batcher import BatcherConfig

SECTIONS = {"batcher": BatcherConfig, "admission": AdmissionConfig}


def override(spec: str) -> tuple[type, str, object]:
    """'batcher.load_wait_share=0.5' -> (BatcherConfig, 'load_wait_share', 0.5); ValueError naming what is wrong."""
    name, sep, text = spec.partition("=")
    section, dot, field = name.partition(".")
    if not sep or not dot or section not in SECTIONS:
        raise ValueError(f"--set {spec!r}: expected SECTION.FIELD=VALUE with SECTION one of {sorted(SECTIONS)}")
    config = SECTIONS[section]
    fields = {f.name: f for f in dataclasses.fields(config)}
    if field not in fields or fields[field].default is dataclasses.MISSING:
        raise ValueError(f"--set {spec!r}: {config.__name__} has no field {field!r} with a plain default")
    default = fields[field].default
    kind = type(default)
    if kind is bool:
        if text not in ("true", "false"):
            raise ValueError(f"--set {spec!r}: {field} takes true or false")
        return config, field, text == "true"
    try:
        return config, field, kind(text)
    except ValueError:
        raise ValueError(f"--set {spec!r}: {field} takes a {kind.__name__}") from None


def apply(config: type, field: str, value: object) -> None:
    """Makes `value` the field's default for every later `config(...)` that does not pass it."""
    init = config.__init__
    names = [f.name for f in dataclasses.fields(config) if f.init]
    defaults = list(init.__defaults__)
    # a dataclass's __init__ defaults are those of its last len(defaults) init fields, in order
    index = names.index(field) - (len(names) - len(defaults))
    if index < 0:
        raise ValueError(f"{config.__name__}.{field} has no default to replace")
    defaults[index] = value
    init.__defaults__ = tuple(defaults)
    for f in dataclasses.fields(config):
        if f.name == field:
            f.default = value


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m ops.bench.serve_tuned", description=__doc__.split("\n\n")[0])
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = p.parse_args(own)
    try:
        changes = [override(s) for s in args.set]
    except ValueError as e:
        print(f"serve_tuned: error: {e}", file=sys.stderr)
        return 2
    for config, field, value in changes:
        apply(config, field, value)
        print(f"[serve_tuned] {config.__name__}.{field} = {value!r}", file=sys.stderr, flush=True)
    from service.cli import main as cli_main
    return cli_main(["serve", *serve_args])


if __name__ == "__main__":
    sys.exit(main())
