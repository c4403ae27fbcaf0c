"""Model zoo: a torchvision-layout ResNet (tests/models/resnet_bn.py: BatchNorm after every conv, 1x1
downsample shortcuts, a CIFAR stem; SGD with Nesterov momentum and weight decay, StepLR). The zoo
builds it with --sync-batchnorm (tests/helpers/zoo.py BATCH_NORMALIZED)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_zoo_resnet_bn", Path(__file__).parents[1] / "resnet_bn.py")
_resnet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_resnet)

model, batch, optimizer, scheduler = _resnet.model, _resnet.batch, _resnet.optimizer, _resnet.scheduler
