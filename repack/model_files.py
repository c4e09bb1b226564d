"""Which non-weight files of the source a converted checkpoint carries (how they are copied is convert's job).

A model repo needs the config (rewritten by the converter), the generation config, the tokenizer files and the
chat template, remote code when the config points to it, and the source's license; the source's README.md comes
along as ``SOURCE_README.md`` so the generated card can link it without being confused with it. Anything else
in the source folder (quantizer logs, reference outputs, notebooks) stays behind unless ``--include`` names it;
``--exclude`` drops a default. The patterns are ``fnmatch`` globs on the file's path in the folder, as in
``hf upload --include/--exclude``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

SOURCE_README = "SOURCE_README.md"  # the source's own card, under a name that is not the model card's
MODEL_REPO_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",  # sentencepiece tokenizers (tokenizer.model, spiece.model, ...)
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "*.py",  # remote code named by the config's auto_map
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY*",
    "README.md",
)


@dataclass(frozen=True)
class CopiedFile:
    """A source file copied byte for byte, and its name in the output folder."""

    source: str
    output: str


@dataclass(frozen=True)
class FileSelection:
    copied: tuple[CopiedFile, ...]
    left_behind: tuple[str, ...]  # source files neither written by the converter nor copied


def select_model_files(
    files: list[str], reserved: set[str], include: list[str] = (), exclude: list[str] = ()
) -> FileSelection:
    """Split the source's ``files`` (relative paths) into copied and left behind.

    ``reserved`` are the files the converter reads or writes itself (weights, index, config, manifest); they are
    never copied, whatever the patterns say.
    """
    copied, left_behind = [], []
    for name in files:
        if name in reserved:
            continue
        wanted = matches_any(name, MODEL_REPO_FILES) or matches_any(name, include)
        if wanted and not matches_any(name, exclude):
            copied.append(CopiedFile(name, SOURCE_README if name == "README.md" else name))
        else:
            left_behind.append(name)
    return FileSelection(tuple(copied), tuple(left_behind))


def matches_any(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether ``name`` matches one of the ``fnmatch`` globs (``hf upload --include/--exclude`` semantics)."""
    return any(fnmatch(name, pattern) for pattern in patterns)
