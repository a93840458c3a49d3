"""User plug-ins named by a config field: `package.module:NAME` or `path/to/file.py:NAME`.

One loader for every field that takes a plug-in (`task.reward`, `algo.name`), so that they accept the
same two forms and fail with the same kinds of message: one `ValueError` that starts with
`<field>=<ref>: ` and names the missing file, the import failure (with the line of the user's file that
raised), or the missing attribute. A file is imported under a module name derived from its resolved path
(`<prefix>_<sha1[:12]>`), registered in `sys.modules` (dataclasses and pickling inside it need it), so the
same file under two spellings of its path is one module. Ground floor: imports nothing from `moe_gspo`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType


def import_plugin_module(ref: str, *, field: str, prefix: str, attr_form: str) -> ModuleType:
    """The module of `ref` (`module:ATTR` or `file.py:ATTR`); ValueError `"<field>=<ref>: ..."` otherwise.

    `prefix`: the `sys.modules` name prefix of a file's module; `attr_form`: how the field's docs spell the
    attribute in `package.module:<attr_form>` (for the message of a missing file)."""
    where = ref.partition(":")[0]
    try:
        if not where.endswith(".py"):
            return importlib.import_module(where)
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"{field}={ref!r}: file {where!r} does not exist; give a path to a .py file (relative "
                             f"to the working directory) or package.module:{attr_form}")
        mod_name = f"{prefix}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        loader = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[mod_name] = module
        try:
            loader.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
        return module
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module: any failure to import is a user error
        raise ValueError(f"{field}={ref!r}: cannot import {where!r}: {type(e).__name__}: {e}{user_frame(e)}") from None


def user_frame(e: BaseException) -> str:
    """` (at FILE:LINE)` of the innermost frame of `e` outside `moe_gspo` and Python's frozen modules, or ""."""
    package = str(Path(__file__).resolve().parent)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(package) and not f.filename.startswith("<frozen")]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
