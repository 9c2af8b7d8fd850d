"""Stand-in for Horovod (https://github.com/horovod/horovod), which Graphcore's BERT application
imports for its distributed runs only. Under `poprun` the collectives go through
`torch.distributed` (gloo), the process group `popdist` sets up; in a single process they are
the identity, as Horovod's are with one rank. Only `horovod.torch` is provided."""
