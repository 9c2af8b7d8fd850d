"""Enumerations of the PopTorch API (same names, members and values as PopTorch's)."""
import enum


class _Enum(enum.IntEnum):
    """An IntEnum shown as ``Name.Member``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class OutputMode(_Enum):
    """Which results a model call returns to the host.

    - ``All``: one result per micro-batch.
    - ``Final``: only the result of the last micro-batch (per replica).
    - ``EveryN``: the results of every N-th device iteration, N being the
      ``output_return_period`` given to ``Options.outputMode``.
    - ``Sum``: the sum of the results over all micro-batches (per replica).
    - ``Default``: ``All`` for inference models, ``Final`` for training models.
    """
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class ReductionType(_Enum):
    """How values are reduced: summed, averaged or left as they are."""
    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(_Enum):
    """When a mean reduction over accumulation and replicas divides.

    - ``Running``: keep the accumulator as a running mean (numerically safest).
    - ``Post``: sum everything, divide once at the end (fastest, may overflow).
    - ``PostAndLoss``: legacy: divide by the replica count before the backward
      pass and by the accumulation factor afterwards.
    """
    Running = 0
    Post = 1
    PostAndLoss = 2


class DataLoaderMode(_Enum):
    """How a ``DataLoader`` reads its dataset.

    - ``Sync``: in the calling thread, like ``torch.utils.data.DataLoader``.
    - ``Async``: through an ``AsynchronousDataAccessor`` whose worker process
      loads the next batches while the model runs.
    - ``AsyncRebatched``: like ``Async``, but the torch loader produces smaller
      batches (``rebatched_worker_size``) and the accessor's worker assembles
      them into batches of the combined size, so iterable datasets split over
      many workers lose fewer samples.
    """
    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(_Enum):
    """How an ``AsynchronousDataAccessor`` hands the dataset to its worker process.

    - ``SharedMemory``: spawn the worker; the dataset is pickled and its tensors
      travel through shared memory (fast, limited by shared-memory size).
    - ``FileSystem``: spawn the worker; the dataset is pickled to a temporary
      file that the worker loads (slower, no size limit).
    - ``Fork``: fork the worker: nothing is copied up front, but libraries that
      use threads in the parent may misbehave in the child.
    - ``ForkServer``: fork the worker from a single-threaded server process.
    """
    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class ConnectionType(_Enum):
    """When to attach to the device.

    - ``Always``: attach as soon as the model is compiled (default).
    - ``OnDemand``: attach when the model first runs.
    - ``Never``: never attach (offline compilation only).
    """
    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(_Enum):
    """How IPUs synchronise with each other and with the host.

    - ``Full``: every IPU takes part in every host or inter-IPU sync.
    - ``SinglePipeline``: IPUs sync with the host independently.
    - ``ReplicaAndLadder``: groups of IPUs alternate host I/O and compute.
    """
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class HalfFloatCastingBehavior(_Enum):
    """Casting of ops mixing float16 and float32 operands.

    - ``FloatDowncastToHalf``: cast every operand to float16.
    - ``HalfUpcastToFloat``: follow PyTorch's promotion to float32.
    - ``Default``: ``FloatDowncastToHalf`` when tracing.
    """
    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class AutoStage(_Enum):
    """How blocks without an explicit ``Stage`` get their stage.

    - ``SameAsIpu``: the stage is the block's IPU id.
    - ``AutoIncrement``: every new block starts the next stage.
    """
    SameAsIpu = 0
    AutoIncrement = 1


class Liveness(_Enum):
    """Where phased execution keeps tensors between phases.

    - ``AlwaysLive``: on chip.
    - ``OffChipAfterFwd``: off chip between the forward and backward passes.
    - ``OffChipAfterFwdNoOverlap``: as above, without overlapping loads and
      stores between phases.
    - ``OffChipAfterEachPhase``: off chip after every phase.
    """
    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class OverlapMode(enum.Enum):
    """How far host transfers of an input or output (``set_overlap_for_input`` /
    ``set_overlap_for_output``) overlap computation; they go through IO tiles
    (``Options.TensorLocations.numIOTiles``).

    - ``NoOverlap``: the transfer happens when the tensor is needed, as without IO tiles.
    - ``OverlapAccumulationLoop``: the next micro-batch of a gradient accumulation group is loaded
      (and the previous one's output sent) while this one computes.
    - ``OverlapDeviceIterationLoop``: the same across device iterations too: only the first input
      and the last output of a call are not hidden.
    """
    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class MultiConvPlanType(_Enum):
    """How a ``MultiConv``'s convolutions are planned.

    - ``Parallel``: side by side, each on its share of the IPU's tiles (default).
    - ``Serial``: one after the other, each on all the tiles, as separate convolutions.
    """
    Parallel = 0
    Serial = 1


class CommGroupType(_Enum):
    """How replicas are grouped for an input (``Options.inputReplicaGrouping``) or a per-replica
    variable (``model.weight.replicaGrouping``); N replicas in groups of k.

    - ``All``: one group of every replica (a variable's usual case; not valid for inputs).
    - ``Consecutive``: groups {0 .. k-1}, {k .. 2k-1}, ...
    - ``Orthogonal``: with m = N / k groups, {0, m, 2m, ...}, {1, m + 1, ...}, ...
    - ``NoGrouping``: every replica a group of its own.
    """
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class MatMulSerializationMode(enum.Enum):
    """The dimension ``serializedMatMul`` splits A[m, n] @ B[n, p] along.

    - ``InputChannels``: m, the rows of the result (pieces of rows, no sum).
    - ``ReducingDim``: n, the dimension summed over (the pieces' products are
      added up).
    - ``OutputChannels``: p, the columns of the result.
    - ``Disabled``: an ordinary matrix multiplication.
    """
    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class VariableRetrievalMode(_Enum):
    """Which replicas' values of a grouped variable reach the host.

    - ``OnePerGroup``: one value per group, from the group's first replica.
    - ``AllReplicas``: one value per replica.
    """
    OnePerGroup = 0
    AllReplicas = 2
