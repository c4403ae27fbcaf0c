"""A torchvision-layout ResNet (BasicBlock: BatchNorm after every conv, 1x1 downsample shortcuts where
the shape changes; a CIFAR stem: one 3x3 conv, no max-pool), narrow and two blocks deep per stage,
trained as torchvision's CIFAR recipes do: SGD with Nesterov momentum and weight decay, StepLR.
Built with `--sync-batchnorm` it is the deep BatchNorm network of issue #39's second case."""

import torch
from torch import nn
from torch.nn import functional as F

WIDTHS = (8, 16, 32, 64)


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, classes=10, blocks=(2, 2, 2, 2)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, WIDTHS[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(WIDTHS[0])
        layers, inplanes = [], WIDTHS[0]
        for i, (planes, count) in enumerate(zip(WIDTHS, blocks)):
            stage = []
            for j in range(count):
                stage.append(BasicBlock(inplanes, planes, 2 if i > 0 and j == 0 else 1))
                inplanes = planes
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(inplanes, classes)
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def model():
    return ResNet()


def batch(batch_size):
    g = torch.Generator().manual_seed(5)
    return torch.randn(batch_size, 3, 16, 16, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
