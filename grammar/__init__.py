"""The lark grammar of the .rdep language (``rdep.lark`` beside this file)."""

from importlib import resources


def grammar_text() -> str:
    return resources.files(__name__).joinpath("rdep.lark").read_text(encoding="utf-8")
