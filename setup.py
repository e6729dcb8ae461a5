"""Packaging beyond what pyproject.toml can say: the benchmarks and the docs travel inside the
installed ``rrfp`` package (``rrfp/_bench/benchmarks``, ``rrfp/_docs``), so that a plain
``pip install .`` gives ``rrfp bench`` and the guides the commands point to
(:mod:`rrfp.resources` finds them in a source tree or an installation)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["rrfp", "rrfp.*"]) + ["rrfp._bench.benchmarks", "rrfp._docs"],
    package_dir={"rrfp._bench.benchmarks": "benchmarks", "rrfp._docs": "docs"},
    package_data={"rrfp._docs": ["*.md", "**/*.md", "*.png", "*.svg"]},
)
