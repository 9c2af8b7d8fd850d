"""The network of Graphcore's PopTorch pipelining tutorial (MNIST), with its blocks and strategy,
shared by the tests and benchmarks."""
import torch
import torch.nn as nn

import poptorch_lite.api.blocks as blocks
from poptorch_lite.api.strategies import PipelinedExecution, Stage


class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer3_dropout = torch.nn.Dropout(0.5)
        self.layer4 = nn.Linear(256, 10)
        self.softmax = nn.LogSoftmax(1)

    def forward(self, x):
        with blocks.Block("B1"):
            x = self.layer1(x)
        with blocks.Block("B2"):
            x = self.layer2(x)
        with blocks.Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
            x = self.layer3_dropout(x)
        with blocks.Block("B4"):
            x = self.layer4(x)
            x = self.softmax(x)
        return x


class TrainingModelWithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.NLLLoss()

    def forward(self, args, loss_inputs=None):
        output = self.model(args)
        if loss_inputs is None:
            return output
        with blocks.Block("B4"):
            loss = self.loss(output, loss_inputs)
        return output, loss


TUTORIAL_STRATEGY = PipelinedExecution(Stage("B1").ipu(0), Stage("B2").ipu(1), Stage("B3").ipu(2), Stage("B4").ipu(3))
