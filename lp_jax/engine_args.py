"""Engine flags, generated from EngineConfig's fields: each flag is written once.

A field of EngineConfig whose metadata has a `help` is a flag; lp_jax/engine/config.py's
`engine_arg` writes that metadata. The flag's spelling is --the-field-name (or the metadata's
`flags`), its type the metadata's `type` (a parser of PARSERS) or the default's type, a
bool becomes --name / --no-name, and its default and help are the field's. A command
takes all these flags (`lp serve`) or a subset (`lp aot`), and may override a default,
in which case the help says both values.

Parsed defaults are EngineConfig's own, so the dataclass stays the one place that
decides them; a default computed at run time (a default_factory) is left to the
dataclass and shown by its `default_help`. `engine_kwargs` turns parsed flags back into
EngineConfig's keyword arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _unit_interval(s: str) -> float:
    v = float(s)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {s}")
    return v


def _int_tuple(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def _layer_groups(s: str):
    return int(s) if s.isdigit() else s


def _existing_path(s: str) -> str:
    if not Path(s).exists():
        raise argparse.ArgumentTypeError(f"{s!r} does not exist")
    return s


def _slo_classes(s: str) -> dict:
    """Inline JSON or a JSON file's path, checked now (a bad file stops start-up with its
    error, not the first request that names a class)."""
    from lp_jax.core.slo import parse_slo_classes

    try:
        text = s if s.lstrip().startswith("{") else Path(s).read_text()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read SLO classes file {s!r}: "
                                         f"{exc.strerror}") from None
    try:
        spec = json.loads(text)
        parse_slo_classes(spec)
    except ValueError as exc:  # JSONDecodeError included
        raise argparse.ArgumentTypeError(f"bad SLO classes in {s[:200]!r}: {exc}") from None
    return spec


def _json(s: str):
    """Inline JSON (vLLM's --speculative-config '{"method": ...}' shape)."""
    try:
        return json.loads(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected JSON, got {s[:200]!r}: {exc}") from None


def _speculative_config(s: str):
    """--speculative-config: vLLM's JSON, checked now (lp_jax/spec/config.py)."""
    from lp_jax.spec.config import SpeculativeConfig

    value = _json(s)
    try:
        SpeculativeConfig.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


PARSERS = {"positive_int": positive_int, "non_negative_int": _non_negative_int,
           "positive_float": positive_float, "unit_interval": _unit_interval,
           "int_tuple": _int_tuple, "layer_groups": _layer_groups,
           "existing_path": _existing_path, "slo_classes": _slo_classes, "json": _json,
           "speculative_config": _speculative_config}


@dataclasses.dataclass(frozen=True)
class Flag:
    """One engine flag, as argparse and the docs need it."""

    name: str  # EngineConfig's field
    spellings: tuple[str, ...]
    help: str
    default: object  # dataclasses.MISSING: computed by EngineConfig at run time
    default_help: str | None
    type: object = None
    choices: tuple | None = None
    metavar: str | None = None
    is_bool: bool = False
    empty_is_none: bool = False

    def default_text(self) -> str:
        if self.default_help is not None:
            return self.default_help
        if self.is_bool:
            return "on" if self.default else "off"
        return "none" if self.default is None else str(self.default)


def engine_flags(config_cls=None) -> dict[str, Flag]:
    """Every flag of `config_cls` (EngineConfig), by field name, in field order."""
    if config_cls is None:
        from lp_jax.engine.config import EngineConfig as config_cls
    flags = {}
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        unknown = set(meta) - {"help", "flags", "type", "choices", "metavar", "default_help",
                               "empty_is_none"}
        if unknown:
            raise ValueError(f"EngineConfig.{f.name}: unknown flag settings {sorted(unknown)}")
        default = f.default
        is_bool = isinstance(default, bool)
        if "type" in meta:
            parse = PARSERS[meta["type"]]
        elif is_bool or "choices" in meta or default is None or default is dataclasses.MISSING:
            parse = None
        else:
            parse = type(default)
        flags[f.name] = Flag(
            name=f.name, spellings=tuple(meta.get("flags", (f"--{f.name.replace('_', '-')}",))),
            help=meta["help"], default=default, default_help=meta.get("default_help"),
            type=parse, choices=tuple(meta["choices"]) if "choices" in meta else None,
            metavar=meta.get("metavar"), is_bool=is_bool,
            empty_is_none=meta.get("empty_is_none", False))
    return flags


def add_engine_args(parser, *, only=None, defaults=None, extra_spellings=None,
                    default_help=None, config_cls=None) -> list[str]:
    """Add the engine flags to `parser` (a parser or an argument group).

    only: the field names to add, in this order (default: all). defaults: {field: value}
    this command uses instead of EngineConfig's; its help names both. extra_spellings:
    {field: (spelling, ...)} this command also accepts. default_help: {field: words}
    describing an overridden default. Returns the field names added (for engine_kwargs).
    """
    flags = engine_flags(config_cls)
    names = list(flags) if only is None else list(only)
    defaults, default_help = defaults or {}, default_help or {}
    for name in names:
        flag = flags[name]
        spellings = flag.spellings + tuple((extra_spellings or {}).get(name, ()))
        kw = {"dest": name, "help": flag.help}
        if name in defaults or name in default_help:
            here = default_help.get(name, defaults.get(name))
            kw["help"] += f" [default here: {here}; the engine's: {flag.default_text()}]"
        else:
            kw["help"] += f" [default: {flag.default_text()}]"
        kw["help"] = kw["help"].replace("%", "%%")
        if flag.is_bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update({k: v for k, v in (("type", flag.type), ("choices", flag.choices),
                                         ("metavar", flag.metavar)) if v is not None})
        default = defaults.get(name, flag.default)
        kw["default"] = None if default is dataclasses.MISSING else default
        parser.add_argument(*spellings, **kw)
    return names


def engine_kwargs(args, names=None, config_cls=None) -> dict:
    """EngineConfig's keyword arguments from parsed flags (`names`, default: every engine
    flag `args` holds): a flag left at a computed default (None) is left out, so that the
    dataclass computes it; '' means None where the field says so (--compilation-cache-dir
    '')."""
    flags = engine_flags(config_cls)
    if names is None:
        names = [n for n in flags if hasattr(args, n)]
    kwargs = {}
    for name in names:
        flag, value = flags[name], getattr(args, name)
        if flag.default is dataclasses.MISSING and value is None:
            continue
        kwargs[name] = None if flag.empty_is_none and value == "" else value
    return kwargs


def markdown(config_cls=None) -> str:
    """docs/engine_args.md: one row per flag, as `lp serve` takes it."""
    lines = ["# Engine arguments", "",
             "Generated from EngineConfig's fields (lp_jax/engine/config.py) by "
             "`lp engine-args --out docs/engine_args.md`; edit the fields' help there, not "
             "this file.", "",
             "Each is a keyword argument of `LLM(model, ...)` and `EngineConfig`, and a flag "
             "of `lp serve`. `lp aot` takes the ones that shape its programs, with its own "
             "defaults for `--max-model-len` and `--mesh-shape` (see `lp aot --help`). A "
             "bool flag `--x` also has `--no-x`.", "",
             "| argument | flag | default | meaning |", "| --- | --- | --- | --- |"]
    for flag in engine_flags(config_cls).values():
        choices = f" One of: {', '.join(map(str, flag.choices))}." if flag.choices else ""
        spell = ", ".join(f"`{s}`" for s in flag.spellings)
        cell = f"{flag.help}{choices}".replace("|", "\\|")
        lines.append(f"| `{flag.name}` | {spell} | {flag.default_text()} | {cell} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="lp engine-args",
                                description="print (or write) docs/engine_args.md")
    p.add_argument("--out", default=None, help="write the table here instead of stdout")
    args = p.parse_args(argv)
    text = markdown()
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
