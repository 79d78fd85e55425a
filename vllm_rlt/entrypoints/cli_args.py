"""Command-line flags generated from the config dataclasses, so `--help` is the reference.

Each config field `foo_bar` becomes `--foo-bar` with the field's documented help, its default and,
for an enumerated setting, its `choices`; booleans become switches with a `--no-foo-bar` form.
Generated flags default to None, so that an unset flag keeps the config's default (which the help
shows). The model is `MODEL` or `--model MODEL` in every command. Sampling fields that the engine
config already sets for every request (seed, exit_threshold) are not repeated.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any, NoReturn

from vllm_rlt.config import SECTIONS
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.serve_config import SERVE_SECTIONS

SAMPLING_HELP = {
    "n": "samples per prompt",
    "max_tokens": "tokens to generate per sample",
    "temperature": "0 = greedy",
    "top_p": "nucleus sampling mass in (0, 1]",
    "top_k": "keep the k most likely tokens (0 = off)",
    "min_p": "keep the tokens at least min_p times as likely as the most likely (0 = off)",
    "min_loops": "fewest loops a decode token runs (default: 1)",
    "max_loops": "most loops a decode token runs (Huginn: every position, the prompt too), at "
    "most the model's depth (default: the depth)",
    "ignore_eos": "keep generating after EOS",
    "stop_token_ids": "token ids that end a sample (default: none)",
    "stop": "strings that end a sample, excluded from the text (default: none)",
    "logprobs": "top alternatives to report per token, 0-20 (default: none)",
}
MODEL_HELP = "HF model directory (default: the packaged tiny-ouro-stdlib)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless the help text already says it or the default is None
    (a generated flag, whose help carries the config's default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "default:" in text:
            return text
        return super()._get_help_string(action)


class CLIParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (`PROG: error: MESSAGE`, status 2),
    whose help shows defaults and which takes no abbreviated flag (`--max-num-seq` is an error,
    not `--max-num-seqs`); subcommand parsers inherit all three."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def port(text: str) -> int:
    """argparse type of a TCP port (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0: any free port), got {value}")
    return value


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """`MODEL` (positional) or `--model MODEL`; `resolve_model` merges them after parsing."""
    parser.add_argument("model", nargs="?", help=MODEL_HELP)
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help=MODEL_HELP)


def resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Sets `args.model` from either form; a usage error when both are given and differ."""
    option = vars(args).pop("model_option", None)
    if option is None:
        return
    if args.model is not None and args.model != option:
        parser.error(f"the model is given twice: MODEL {args.model!r} and --model {option!r}")
    args.model = option


def _help_with_default(text: str, default: Any) -> str:
    if "default:" in text or default in (None, (), dataclasses.MISSING):
        return text
    return f"{text} (default: {default})"


def add_config_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    helps: dict[str, str] | None = None,
    names: tuple[str, ...] | None = None,
) -> None:
    """A flag per documented field of the dataclass `cls` (`names`: only these); `helps`
    replaces the fields' `help` metadata."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        text = (helps or {}).get(f.name, f.metadata.get("help"))
        if f.name == "model" or text is None or (names is not None and f.name not in names):
            continue
        flag = "--" + f.name.replace("_", "-")
        text = _help_with_default(text, f.default)
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
            continue
        union = typing.get_origin(kind) in (typing.Union, types.UnionType)
        inner = ([t for t in typing.get_args(kind) if t is not type(None)] if union else [kind])[0]
        if typing.get_origin(inner) is tuple:
            parser.add_argument(flag, nargs="+", type=typing.get_args(inner)[0], help=text)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag, type=inner, choices=choices, default=None, help=text)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for name, cls in SECTIONS.items():
        add_config_args(parser.add_argument_group(f"{name} options"), cls)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The settings of `vllm-rlt serve` beyond one engine's (prefill/decode disaggregation)."""
    for name, cls in SERVE_SECTIONS.items():
        add_config_args(parser.add_argument_group(f"{name} options"), cls)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling options")
    add_config_args(group, SamplingParams, SAMPLING_HELP, names=tuple(SAMPLING_HELP))


def config_kwargs(args: argparse.Namespace, classes: typing.Iterable[type]) -> dict[str, Any]:
    """The fields of `classes` given on the command line (unset flags keep the defaults)."""
    names = {f.name for cls in classes for f in dataclasses.fields(cls)} - {"model"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields given on the command line (unset flags keep the config defaults)."""
    return config_kwargs(args, SECTIONS.values())


def error_exit(err: Exception | str) -> SystemExit:
    """The exit of a command that cannot run: `error: <message>` as one line on stderr, status 1
    (SystemExit prints it)."""
    sys.stdout.flush()
    return SystemExit("error: " + " ".join(str(err).split()))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    given = {k: v for k, v in vars(args).items() if k in SAMPLING_HELP and v is not None}
    return SamplingParams(**given)
