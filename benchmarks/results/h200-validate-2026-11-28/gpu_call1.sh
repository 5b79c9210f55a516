bash .gpu/part-01/install.sh --absorb-only 2>&1 | tail -3; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
