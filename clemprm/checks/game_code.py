"""A game's code read, never run (:mod:`clemprm.checks.game_inputs` asks): the modules its ``master.py`` imports at
module level, followed through the game's own modules (decoded as Python decodes them and read with :mod:`ast`),
and whether each is importable here (else what installs it); the NLTK data it downloads at import time
(``nltk.download("stopwords")`` in taboo, ``"wordnet"`` in taboo and codenames) and whether NLTK finds it; whether
it logs per-turn scores. A file Python cannot compile is a ``SyntaxError`` naming the file (:func:`code_error`).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path


def local_roots(game_dir: Path) -> list[Path]:
    """The folders clemcore puts on ``sys.path`` for a game: the game folder, and its parent when the folder's name
    starts with the parent's (``textmapworld/textmapworld_main``)."""
    game_dir = Path(game_dir).resolve()
    return [game_dir] + ([game_dir.parent] if game_dir.name.startswith(game_dir.parent.name) else [])


def game_imports(game_dir: Path) -> tuple[set[str], list[str]]:
    """``(top-level modules the game imports from outside its folders, NLTK data packages it downloads)``: from
    ``master.py`` and, transitively, the game's own modules it imports; module level only (imports inside
    functions run later, or never)."""
    roots = local_roots(game_dir)
    external: set[str] = set()
    nltk_data: list[str] = []
    todo, seen = [Path(game_dir) / "master.py"], set()
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        tree = ast.parse(python_source(path), filename=str(path))
        for node in module_level_nodes(tree):
            if isinstance(node, ast.Call) and nltk_download_target(node):
                nltk_data.append(nltk_download_target(node))
            for module, maybe_attribute in imported_modules(node):
                local = local_module_file(module, roots)
                if local is not None:
                    todo.append(local)
                elif not maybe_attribute and module.split(".")[0] not in sys.stdlib_module_names:
                    external.add(module.split(".")[0])
    return external, list(dict.fromkeys(nltk_data))


def python_source(path: Path) -> str:
    """A Python file's text decoded as the interpreter decodes it on import: its coding line (PEP 263) or UTF-8, a
    byte-order mark dropped (``importlib.util.decode_source``); ``SyntaxError`` naming the file for a coding it cannot
    decode with."""
    try:
        return importlib.util.decode_source(path.read_bytes())
    except (SyntaxError, UnicodeDecodeError, LookupError) as error:   # bytes not in its coding, an unknown coding
        message = error.msg if isinstance(error, SyntaxError) else str(error)
        raise SyntaxError(f"{message} (Python reads a file in the coding of its coding line, else in UTF-8)",
                          (str(path), getattr(error, "lineno", None) or 1, 0, None)) from error


def module_level_nodes(tree: ast.Module):
    """Every node of a module except those inside function bodies (those run only when called)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def imported_modules(node: ast.AST) -> list[tuple[str, bool]]:
    """``(module, maybe an attribute)`` per module an import statement may load: ``from a import b`` loads ``a``
    and, when ``a.b`` is a module rather than a name in ``a``, ``a.b`` too."""
    if isinstance(node, ast.Import):
        return [(alias.name, False) for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [(node.module, False)] + [(f"{node.module}.{alias.name}", True) for alias in node.names]
    return []


def local_module_file(module: str, roots: list[Path]) -> Path | None:
    """The file of ``module`` in the game's folders (a module or a package's ``__init__``), else None."""
    parts = module.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        if base.is_dir():  # a namespace package of the game
            return base / "__init__.py"
    return None


def nltk_download_target(node: ast.Call) -> str | None:
    """``"stopwords"`` for a call ``nltk.download("stopwords", ...)``, else None."""
    func = node.func
    if (isinstance(func, ast.Attribute) and func.attr == "download" and isinstance(func.value, ast.Name)
            and func.value.id == "nltk" and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return node.args[0].value
    return None


def code_error(error: Exception) -> str:
    """A game file that Python cannot compile, as ``file, line N: message``."""
    if isinstance(error, SyntaxError):
        return f"{error.filename}, line {error.lineno}: {error.msg}"
    return str(error)


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


CLEMBENCH_EXTRA_MODULES = ("lark", "jinja2", "networkx")
"""The modules clemprm's ``clembench`` extra installs (pyproject.toml)."""
MODULE_PACKAGES = {"clingo": "clingo", "sklearn": "scikit-learn", "spacy": "spacy", "yaml": "pyyaml",
                   "PIL": "pillow", "cv2": "opencv-python", "bs4": "beautifulsoup4", "Levenshtein": "levenshtein"}
"""The pip package of a module whose name is not the package's, or that the ``clembench`` extra does not install."""


def install_hint(modules: list[str]) -> str:
    """What installs ``modules``: clemprm's ``clembench`` extra for those it holds, pip for the others (by package
    name where it differs from the module's)."""
    extra = [module for module in modules if module in CLEMBENCH_EXTRA_MODULES]
    others = [MODULE_PACKAGES.get(module, module) for module in modules if module not in CLEMBENCH_EXTRA_MODULES]
    hints = [f'pip install -e ".[clembench]" installs {", ".join(extra)}'] if extra else []
    if others:
        hints.append(f"pip install {' '.join(others)} (not in clemprm's clembench extra)")
    return "; ".join(hints)


NLTK_DATA_FOLDERS = ("corpora", "tokenizers", "taggers", "chunkers", "grammars", "models", "misc", "sentiment",
                     "stemmers")
"""Where NLTK keeps a data package, by kind (``nltk.data.find("corpora/stopwords")``)."""


def nltk_data_installed(package: str) -> bool:
    """Whether NLTK finds the data package ``package`` (as a folder or a zip) on its data path."""
    import nltk

    for folder in NLTK_DATA_FOLDERS:
        try:
            nltk.data.find(f"{folder}/{package}")
            return True
        except LookupError:
            continue
    return False


TURN_SCORES_MARKS = ("TURN_SCORES_EVENT", '"turn scores"', "'turn scores'")
"""What the code of a game that logs per-turn scores holds (:data:`clemprm.games.common.TURN_SCORES_EVENT`)."""


def logs_turn_scores(game_dir: Path) -> bool:
    """Whether a game's code (its folder's Python files, read, not run) logs per-turn scores: it names
    :data:`clemprm.games.common.TURN_SCORES_EVENT` or its text."""
    return any(mark in python_source(path) for path in Path(game_dir).rglob("*.py") for mark in TURN_SCORES_MARKS)
