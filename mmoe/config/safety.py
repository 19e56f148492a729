"""What every ``mmoe`` config read is protected by, installed once per process (:func:`install_config_safety`):

* config files (and the files they name) are read by :func:`mmoe.config.yaml_reading.load_yaml_config`: no duplicate
  key, aliases bounded; each command-line value is held to the same checks before parsing starts
  (:func:`refuse_unsafe_command_line`: jsonargparse reads a value as YAML more than once, its later reads not through
  the installed loader); a ``--config`` file's ``extends`` part is merged in (:mod:`mmoe.config.extends`), and its
  lists of classes (``trainer.callbacks``) into those of the ``--config`` files before it, by class, as ``extends``
  merges them (:func:`with_earlier_class_lists`: a later file adds or changes a callback, never drops one); a class
  named by the module it lived in before (:mod:`mmoe.config.moved_classes`) is read as the module it is in now;
* a file that is not a config (plain text such as ``/etc/passwd``), given as ``--config`` or as a config value, is
  refused in one line naming the file and never quoting its content (:class:`NotAConfigFile`);
* a ``class_path`` (or a class named by itself, ``--model X``, ``--trainer.callbacks+=X``) is imported only from
  :data:`ALLOWED_PACKAGES`, in files and on the command line alike; any other is refused before its module is
  imported, since importing a module runs its code. From Python, ``jsonargparse.set_parsing_settings(
  import_path_allowlist=[...])`` allows more.

:func:`config_error_line` turns a parse error into the one line ``mmoe <command>: error: ...`` prints, with the
values it quotes cut short.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentError, ArgumentParser, Namespace, get_loader, set_loader, set_parsing_settings

from mmoe.config.extends import EXTENDS_KEY, extended_config, is_class_list, merged
from mmoe.config.moved_classes import current_class_paths
from mmoe.config.yaml_reading import ConfigFileError, check_yaml_config, load_yaml_config, shorten
from mmoe.io import one_line, report_error
from mmoe.runtime.lightning_internals import config_before_file, config_file_being_read

#: The packages a config may name classes from: mmoe's tasks, DataModules and callbacks, and Lightning's callbacks,
#: loggers, strategies and plugins (what the shipped configs and the docs name). Not all of torch: a module such as
#: ``torch.utils.model_dump.__main__`` runs a program when imported.
#: ``lightning.LightningModule`` / ``lightning.LightningDataModule`` are the base classes the mmoe CLI names when a
#: config gives no ``class_path`` (the top-level ``lightning`` package itself is not allowed).
ALLOWED_PACKAGES = (
    "mmoe",
    "lightning.pytorch",
    "lightning.fabric",
    "pytorch_lightning",
    "lightning_fabric",
    "lightning.LightningModule",
    "lightning.LightningDataModule",
)

#: The longest parse error printed; a longer one is cut, saying how much was left out.
MAX_ERROR_CHARACTERS = 2000

_DENIED_IMPORT = re.compile(r"Importing '([\w.]+)' is not allowed")
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')


class NotAConfigFile(ConfigFileError):
    """A file read as a config (``--config``, or a path given as a config value) that holds no settings: plain text
    or, for ``--config``, anything but a mapping. Its content is never quoted: it may be any file of the machine."""


def install_config_safety() -> None:
    """Makes jsonargparse read YAML with :func:`load_yaml_config` and import classes named by a config only from
    :data:`ALLOWED_PACKAGES`. Idempotent; the settings are the process's (jsonargparse keeps them globally)."""
    current = get_loader("yaml")
    if getattr(current, "checks_config", False):
        return

    def load(text: str, path: Any = "") -> Any:
        value = load_yaml_config(text, file_being_read(path), current)
        refuse_file_without_settings(text, value, path)
        if path and isinstance(value, dict) and EXTENDS_KEY in value:
            value = extended_config(value, file_being_read(path), current)
        if path and isinstance(value, dict):
            value = with_earlier_class_lists(value, config_before_file())
        return current_class_paths(value)

    load.checks_config = True  # type: ignore[attr-defined]
    set_loader("yaml", load, exceptions=(yaml.YAMLError,))
    set_parsing_settings(import_path_denylist=["*"], import_path_allowlist=list(ALLOWED_PACKAGES))


def with_earlier_class_lists(value: Any, earlier: Any) -> Any:
    """``value``, the settings of a ``--config`` file, with each list of classes it gives (``trainer.callbacks``)
    merged by class into the list ``earlier`` (the config parsed before the file) holds at that key
    (:func:`mmoe.config.extends.merged`); other settings are left to the parser, which lays them over ``earlier``."""
    if isinstance(value, dict) and isinstance(earlier, Namespace):
        return {key: with_earlier_class_lists(item, earlier.get(key)) for key, item in value.items()}
    if is_class_list(value) and isinstance(earlier, list) and earlier:
        before = [item.as_dict() if isinstance(item, Namespace) else item for item in earlier]
        if is_class_list(before):
            return merged(before, value)
    return value


def file_being_read(path: Any) -> str:
    """The full path of the config file jsonargparse is reading: ``path`` is its base name, read with the working
    folder set to the file's own; a file named inside a config (``--moe moe.yaml``, ``model: model.yaml``) comes
    without a name, and is found on jsonargparse's stack of files being read. "" for a command-line value."""
    if path:
        return os.path.abspath(path)
    return config_file_being_read()


def refuse_file_without_settings(text: str, value: Any, path: Any) -> None:
    """Raises :class:`NotAConfigFile` when ``text``, built into ``value``, is the whole content of a file read as a
    config and holds no settings: anything but a mapping (or nothing) for a ``--config`` file (``path`` given), a
    plain string for a file named as a config value (one holding a list or a mapping may fill a field)."""
    if path:
        if value is None or isinstance(value, dict):
            return
        raise NotAConfigFile(
            f"config {file_being_read(path)}: not a config file: it holds no mapping of settings (its content is not "
            "shown)"
        )
    if not isinstance(value, str):
        return
    file = config_file_being_read()
    if file and is_whole_content(file, text):
        raise NotAConfigFile(
            f"the value names {file}, which is not a config file: it holds plain text, not settings (its content is "
            "not shown)"
        )


def is_whole_content(file: str, text: str) -> bool:
    """Whether ``text`` is the whole content of ``file``: jsonargparse reads a file named as a value, and a string
    value of that file, with the same file on its stack of files being read."""
    try:
        size = os.stat(file).st_size
        return len(text) <= size <= 4 * len(text) + text.count("\n") and Path(file).read_text() == text
    except (OSError, ValueError):
        return False


def refuse_unsafe_command_line(args: Any) -> None:
    """Raises ``ArgumentError`` for the first value of the argv list ``args`` that a config file could not hold (a
    key given twice, aliases that expand past the bound), naming its option: jsonargparse reads a command-line value
    as YAML more than once, and only its first read goes through the installed loader. Text that is not YAML is left
    to the parser, which takes it as a string."""
    if not isinstance(args, list | tuple):
        return
    option = ""
    for arg in args:
        if not isinstance(arg, str):
            continue
        name, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if name and not equals:
            option = name
            continue
        try:
            check_yaml_config(value, f"command-line value of {name or option or repr(value[:50])}")
        except ConfigFileError as error:
            raise ArgumentError(None, one_line(error)) from error
        except yaml.YAMLError:
            pass
        option = ""


def config_error_line(error: BaseException) -> str:
    """The one line that says why a config did not parse: the loader's own message when it refused the file, the
    class path outside :data:`ALLOWED_PACKAGES` when one was named, else jsonargparse's message folded on one line and
    cut to :data:`MAX_ERROR_CHARACTERS`."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, NotAConfigFile) and _PARSER_KEY.search(str(error)):
            return f"{'.'.join(_PARSER_KEY.findall(str(error)))}: {one_line(cause)}"
        if isinstance(cause, ConfigFileError):
            return one_line(cause)
        cause = cause.__cause__ or cause.__context__
    message = str(error)
    denied = _DENIED_IMPORT.search(message)
    if denied:
        allowed = ", ".join(ALLOWED_PACKAGES)
        return f"class path {denied.group(1)} is not in an allowed package ({allowed}); it was not imported"
    return shorten(one_line(message), MAX_ERROR_CHARACTERS)


@contextmanager
def parse_errors_in_one_line(parsers: Sequence[ArgumentParser], args: Any) -> Iterator[None]:
    """Within, a parse error of ``parsers`` (a parser and its subcommands' parsers) that would print the usage and
    exit ends the command instead with :func:`config_error_line` on stderr, exit code 2, as ``mmoe <command>``
    (the first word of the argv list ``args``). Parsers that raise their errors (``exit_on_error=False``,
    :func:`mmoe.config.launch.read_config`) are left to do so."""
    words = [arg for arg in args if isinstance(arg, str) and not arg.startswith("-")] if isinstance(args, list) else []
    command = words[0] if words else "fit"
    exiting = [parser for parser in parsers if parser.exit_on_error]
    if len(exiting) < len(parsers):
        yield
        return
    for parser in exiting:
        parser.exit_on_error = False
    try:
        refuse_unsafe_command_line(args)
        yield
    except ArgumentError as error:
        raise SystemExit(report_error(command, config_error_line(error))) from None
    finally:
        for parser in exiting:
            parser.exit_on_error = True
