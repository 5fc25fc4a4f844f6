"""GraphSAGE training with node features served by ibpcache through DGL (needs ``pip install -e ".[dgl]"``).

``pipeline`` holds the training loop and the side-by-side comparison of fetch modes; ``examples/train_sage.py``
is its Hydra entry point and ``scripts/train_gnn.py`` the benchmark over every data set.
"""
