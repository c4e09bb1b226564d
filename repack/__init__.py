__version__ = "0.1.0"
SOURCE_URL = "https://github.com/moe-repack/moe-repack"  # pyproject's [project.urls] Source (tests/cli/test_card.py)
