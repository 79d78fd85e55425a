"""Command-line flags generated from the config dataclasses, so `--help` is the reference.

Each config field `foo_bar` becomes `--foo-bar` with the field's documented help; booleans become
switches with a `--no-foo-bar` form. `model` is positional in every command and so is not
generated. Sampling fields that the engine config already sets for every request (seed,
exit_threshold) are not repeated.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from vllm_rlt.config import SECTIONS
from vllm_rlt.sampling_params import SamplingParams

SAMPLING_HELP = {
    "n": "samples per prompt",
    "max_tokens": "tokens to generate per sample",
    "temperature": "0 = greedy",
    "top_p": "nucleus sampling mass in (0, 1]",
    "top_k": "keep the k most likely tokens (0 = off)",
    "min_loops": "fewest loops a decode token runs",
    "max_loops": "most loops a decode token runs (<= model depth)",
    "ignore_eos": "keep generating after EOS",
    "stop_token_ids": "token ids that end a sample",
    "stop": "strings that end a sample (excluded from the text)",
    "logprobs": "top alternatives to report per token (0-20)",
}


def _add_fields(parser: argparse.ArgumentParser, cls: type, helps: dict[str, str]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "model" or f.name not in helps:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=helps[f.name]
            )
            continue
        base = [t for t in typing.get_args(kind) if t is not type(None)] or [kind]
        inner = base[0]
        if typing.get_origin(inner) is tuple:
            parser.add_argument(flag, nargs="+", type=typing.get_args(inner)[0], help=helps[f.name])
        else:
            parser.add_argument(flag, type=inner, default=None, help=helps[f.name])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for name, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{name} options")
        helps = {
            f.name: f.metadata["help"] for f in dataclasses.fields(cls) if "help" in f.metadata
        }
        _add_fields(group, cls, helps)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    _add_fields(parser.add_argument_group("sampling options"), SamplingParams, SAMPLING_HELP)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields given on the command line (unset flags keep the config defaults)."""
    names = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)} - {"model"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def error_exit(err: Exception) -> SystemExit:
    """The exit of a command that cannot run: `error: <message>` as one line on stderr."""
    return SystemExit("error: " + " ".join(str(err).split()))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    given = {k: v for k, v in vars(args).items() if k in SAMPLING_HELP and v is not None}
    return SamplingParams(**given)
