"""Workers: starting the processes of one group and joining them to it.

`launch` (the local launcher on torch.multiprocessing, torchrun's environment, teardown)
and `forkserver` (forking workers from a server that imported torch once). Imports
nothing of shardtrain but `shardtrain.errors`; the layers above hand it the function each
worker runs.
"""
