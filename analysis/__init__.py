"""Reports on training runs and probes: `python -m analysis.report` (one run or probe JSON),
`python -m analysis.compare` (several runs grouped into arms; used by `python -m moe_gspo.ablate`).

Modules: `load` (reading run directories robustly, headline numbers), `figures` (matplotlib/seaborn
figures), `report` (HTML + Markdown assembly, CLI), `compare` (multi-run comparison).
"""
