"""ament_python package gemma_spec_dev: the rigs that measure and stress gemma_spec_ros from outside
(bench and soak). Not needed on a robot: ``colcon build --packages-skip gemma_spec_dev``."""
from setuptools import find_packages, setup

PACKAGE = "gemma_spec_dev"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(include=[PACKAGE, PACKAGE + ".*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + PACKAGE]),
        ("share/" + PACKAGE, ["package.xml"]),
    ],
    install_requires=["setuptools", "numpy", "pyyaml"],
    zip_safe=True,
    maintainer="gemma_spec_ros maintainers",
    maintainer_email="gemma-spec-ros@users.noreply.github.com",
    description="Benchmark and soak rigs for gemma_spec_ros",
    license="Apache-2.0",
    python_requires=">=3.10",
    entry_points={
        "console_scripts": [
            "gemma-spec-bench = gemma_spec_dev.bench:main",
            "gemma-spec-bench-constrained = gemma_spec_dev.bench.constrained:main",
            "gemma-spec-soak = gemma_spec_dev.soak.cli:main",
        ],
    },
)
