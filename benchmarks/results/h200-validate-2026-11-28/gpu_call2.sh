bash .gpu/part-02/install.sh --absorb-only 2>&1 | tail -2
