"""docs/benchmarks.md, rendered from the committed results of one machine (docs/results/).

    python -m bench.report --collect   copy this machine's latest bench/results/ into docs/results/
    python -m bench.report             render docs/benchmarks.md from docs/results/ alone

results.py loads and checks the result files, comparisons/ holds one renderer per benchmark,
page.py puts the page together.
"""
