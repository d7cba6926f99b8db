"""Every option of every verb also reads an environment variable, ``ROLLOUT_FLEET_<DEST>``.

Applied once, in :func:`cli.args.build_parser`, to every action of every subparser, so an
option added later gets its variable without being edited here. Passwords (in a Redis URL) and API
keys then never need to be in argv, where ``ps`` shows them to every user of the host.

The conversion is lazy: :func:`attach_env` only marks the defaults, and :func:`apply_env` converts
the variables of the verb that runs, after parsing, and only for options not given on the command
line (a flag wins; a bad variable of another verb cannot stop this one). Options with their own
environment handling keep it (:data:`OWN_VARS`: the cell flags of ``broker.redis.config`` and the
gateway's keys).

One variable means one thing: where verbs share a dest with different meanings, all but one get a
variable of their own (:func:`name_variable`: ``redis --port`` reads ``ROLLOUT_FLEET_REDIS_PORT``
and ``dashboard --port`` ``ROLLOUT_FLEET_DASHBOARD_PORT``; the gateway keeps
``ROLLOUT_FLEET_PORT``). And a filter a verb takes from the environment (``ROLLOUT_FLEET_MODEL``,
exported for the gateway, is a filter to ``sessions list``) says so on stderr
(:func:`filters_from_env`), so that a list cut short by it is never a silent surprise.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator, Mapping
from typing import Any

from broker.gateway.settings import API_KEY_ENV
from broker.redis.config import ENV_VARS

PREFIX = "ROLLOUT_FLEET_"
# Options whose variables were documented before this module: they keep their names and are read
# where they always were (CellConfig.from_env through cli_args.resolve, gateway_settings).
OWN_VARS: Mapping[str, str] = {**ENV_VARS, "api_keys": API_KEY_ENV}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
# A value of an option whose name says secret is never printed in --help.
_SECRET_WORDS = ("key", "password", "token", "secret")


class EnvError(ValueError):
    """A variable's value was refused; the message names the variable."""


class _FromEnv:
    """The default of an option whose variable is set: converted by :func:`apply_env`."""

    def __init__(self, var: str, raw: str, secret: bool) -> None:
        self.var, self.raw, self.secret = var, raw, secret

    def __str__(self) -> str:  # what --help's %(default)s prints
        return f"${self.var}" if self.secret else f"{self.raw} from ${self.var}"


class _FromEnvList(list[str]):
    """The same for a repeatable option: argparse copies the default list and appends the flags'
    values to the copy, so an empty copy after parsing means no flag was given."""

    var = ""
    raw = ""


_VARIABLE_ATTR = "rollout_fleet_variable"  # set on an option by name_variable


def env_var(action: argparse.Action) -> str:
    """The variable of one option."""
    own: str | None = getattr(action, _VARIABLE_ATTR, None)
    return own or OWN_VARS.get(action.dest) or PREFIX + action.dest.upper()


def name_variable(action: argparse.Action, name: str) -> argparse.Action:
    """Give one option the variable ``ROLLOUT_FLEET_<NAME>`` instead of its dest's: for an option
    whose dest another verb's option shares with another meaning (``--port``)."""
    setattr(action, _VARIABLE_ATTR, PREFIX + name.upper())
    return action


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The options of one parser that take a variable: not --help/--version, not positionals, not
    the copies of global flags whose default is SUPPRESS (the global parser reads their variable)."""
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if action.default is argparse.SUPPRESS:
            continue
        yield action


def attach_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Name each option's variable in its help, and mark the defaults of those that are set."""
    for action in options(parser):
        var = env_var(action)
        set_now = var in environ
        action.help = f"{action.help or ''} [env ${var}{' set' if set_now else ''}]".strip()
        if not set_now or action.dest in OWN_VARS:
            continue
        secret = any(word in action.dest for word in _SECRET_WORDS)
        if isinstance(action, argparse._AppendAction):
            marker = _FromEnvList()
            marker.var, marker.raw = var, environ[var]
            action.default = marker
        else:
            action.default = _FromEnv(var, environ[var], secret)
        action.required = False  # the variable gives it


def apply_env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Replace every marked default still in ``args`` by its converted value; returns the dests
    so set, with their variables. Raises EnvError."""
    read: dict[str, str] = {}
    for action in options(parser):
        value = getattr(args, action.dest, None)
        if isinstance(value, _FromEnvList):
            if not value:
                read[action.dest] = value.var
            setattr(args, action.dest, [_convert(action, value.var, part) for part in shlex.split(value.raw)]
                    if not value else list(value))
        elif isinstance(value, _FromEnv):
            read[action.dest] = value.var
            setattr(args, action.dest, _convert_one(action, value.var, value.raw))
    return read


def filters_from_env(args: argparse.Namespace, filters: Mapping[str, str]) -> str | None:
    """``filtered by --model lm (from $ROLLOUT_FLEET_MODEL), ...`` for the filters (dest -> flag)
    whose value came from the environment (``args.from_env``, set by the CLI's parse), else None."""
    read: Mapping[str, str] = getattr(args, "from_env", {})
    said = [f"{flag} {getattr(args, dest)} (from ${read[dest]})" for dest, flag in filters.items()
            if dest in read and getattr(args, dest, None) is not None]
    return "filtered by " + ", ".join(said) if said else None


def _convert_one(action: argparse.Action, var: str, raw: str) -> Any:
    if action.nargs == 0:  # store_true / store_false / store_const
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise EnvError(f"{var}: expected one of {', '.join(_TRUE + _FALSE[:-1])}, got {raw!r}")
        given = word in _TRUE
        return action.const if given else (not action.const if isinstance(action.const, bool) else None)
    if action.nargs in ("*", "+"):
        return [_convert(action, var, part) for part in shlex.split(raw)]
    return _convert(action, var, raw)


def _convert(action: argparse.Action, var: str, raw: str) -> Any:
    convert = action.type if callable(action.type) else str
    try:
        value = convert(raw)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise EnvError(f"{var}: {raw!r} refused ({exc or 'not a ' + getattr(convert, '__name__', 'value')})") from None
    if action.choices is not None and value not in action.choices:
        raise EnvError(f"{var}: {raw!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def env_map(parser: argparse.ArgumentParser) -> dict[str, dict[str, str]]:
    """verb ('' for the global options) -> option string -> variable: for --help-like listings and
    the tests that check every option has one."""
    table = {"": {action.option_strings[-1]: env_var(action) for action in options(parser)}}
    for verb, sub in subparsers(parser).items():
        table[verb] = {action.option_strings[-1]: env_var(action) for action in options(sub)}
    return table


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The verbs' parsers."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}
