import importlib


def require(module: str, hook: str, package: str):
    """Imports ``module`` for ``hook``, or raises ImportError naming the framework that is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{hook} needs {package}, which is not installed ({e}); install it, or do not import {hook}"
        ) from e
