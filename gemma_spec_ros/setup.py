"""ament_python package gemma_spec_ros: what runs on the robot (the node, its engine, the CLIs).

Its siblings in the repository: gemma_spec_msgs (the interfaces) and gemma_spec_dev (the bench and
soak rigs that drive it from outside)."""
from glob import glob

from setuptools import find_packages, setup

PACKAGE = "gemma_spec_ros"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(include=[PACKAGE, PACKAGE + ".*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + PACKAGE]),
        ("share/" + PACKAGE, ["package.xml"]),
        ("share/" + PACKAGE + "/launch", glob("launch/*.launch.py")),
        ("share/" + PACKAGE + "/config", glob("config/*.yaml")),
        ("share/" + PACKAGE + "/config/aggregator", glob("config/aggregator/*.yaml")),
        ("share/" + PACKAGE + "/config/schemas", glob("config/schemas/*.json")),
        ("share/" + PACKAGE + "/config/examples", glob("config/examples/*.json")),
        # the SROS2 policy and the profiles it includes (relative paths: the layout is kept)
        ("share/" + PACKAGE + "/config/sros2", glob("config/sros2/*.xml")),
        ("share/" + PACKAGE + "/config/sros2/common", glob("config/sros2/common/*.xml")),
        ("share/" + PACKAGE + "/config/sros2/common/node", glob("config/sros2/common/node/*.xml")),
        ("share/" + PACKAGE + "/prompts", glob("prompts/*.yaml")),
    ],
    install_requires=["setuptools", "numpy", "pyyaml"],
    zip_safe=True,
    maintainer="gemma_spec_ros maintainers",
    maintainer_email="gemma-spec-ros@users.noreply.github.com",
    description="Lossless speculative decoding LLM node for ROS 2 over llama.cpp",
    license="Apache-2.0",
    python_requires=">=3.10",
    entry_points={
        "console_scripts": [
            "gemma-spec-serve = gemma_spec_ros.tools.serve:main",
            "gemma-spec-generate = gemma_spec_ros.tools.generate:main",
            "gemma-spec-lookup-create = gemma_spec_ros.tools.lookup_create:main",
            "gemma-spec-eagle3-convert = gemma_spec_ros.tools.eagle3_convert:main",
            "gemma-spec-export-traffic = gemma_spec_ros.tools.export_traffic:main",
            # ros2 run gemma_spec_ros <name>
            "gemma_spec_node = gemma_spec_ros.tools.serve:node_main",
        ],
    },
)
