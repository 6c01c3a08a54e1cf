# hpcgrad port of pytorch/examples distributed/ddp-tutorial-series/datautils.py (commit 77f55b9).
# Changed: the imports (torch -> hpcgrad). The dataset is synthetic already (torch.rand): nothing replaced.
import hpcgrad as torch
from hpcgrad.utils.data import Dataset

class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size
    
    def __getitem__(self, index):
        return self.data[index]
