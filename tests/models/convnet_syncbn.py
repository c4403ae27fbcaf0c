"""convnet_bn.py with its BatchNorm layers made SyncBatchNorm in the model file itself."""

from torch import nn

import convnet_bn

batch, optimizer = convnet_bn.batch, convnet_bn.optimizer


def model():
    return nn.SyncBatchNorm.convert_sync_batchnorm(convnet_bn.model())
