"""Sphinx configuration of hpcgrad's documentation: ``python -m sphinx -W -b html docs OUT``
(tests/run.sh builds it with warnings as errors)."""

import os
import sys

from docutils import nodes
from docutils.parsers.rst import Directive

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

project = "hpcgrad"
author = "the hpcgrad engineers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build", "scaling-runs", "*.md"]
html_theme = "alabaster"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # tensorboardX's docstrings point at its own images
autodoc_default_options = {"members": True, "undoc-members": False}
# hpcgrad's docstrings are plain prose with ``literals``; the Notes inside them read as quoted text.
suppress_warnings = ["autodoc.import_object"]


class SettingsTable(Directive):
    """``.. hpcgrad-settings::``: the table of every HPCGRAD_* setting, from hpcgrad/base/config.py
    (the one place the package reads them), so this page cannot fall behind the code."""

    def run(self):
        from hpcgrad import config
        table = nodes.table()
        group = nodes.tgroup(cols=4)
        table += group
        for width in (30, 14, 28, 40):
            group += nodes.colspec(colwidth=width)
        head, body = nodes.thead(), nodes.tbody()
        group += head
        group += body

        def row(cells, parent):
            line = nodes.row()
            for cell in cells:
                entry = nodes.entry()
                entry += nodes.paragraph(text=cell)
                line += entry
            parent += line

        row(["variable", "default", "read", "what it does"], head)
        for setting in config.SETTINGS:
            meaning = setting.meaning if setting.audience == "user" else \
                f"({setting.audience}) {setting.meaning}"
            row([setting.name, setting.default or "unset", setting.read, meaning], body)
        return [table]


def setup(app):
    app.add_directive("hpcgrad-settings", SettingsTable)
