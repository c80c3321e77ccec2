"""The paper's tables as data and code: published numbers, table specs and claims, a collector of
run records, Markdown/LaTeX/CSV renderers and figures. ``python -m paper_tables --help`` for the CLI;
docs/TABLES.md describes the whole package."""
