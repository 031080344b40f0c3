"""The model and data the optimizer tests share: a 20-32-4 MLP and STEPS batches of 16."""
import torch

STEPS = 5


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dtype)


def data(dtype=torch.float32, steps=STEPS):
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(steps, 16, 20, generator=generator).to(dtype)
    labels = torch.randint(0, 4, (steps, 16), generator=generator)
    return images, labels


def train_whole_batch(dtype=torch.float32):
    """One process on the whole of every batch: what the ranks' steps should equal."""
    torch.set_num_threads(1)
    model = make_model(dtype)
    images, labels = data(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for step in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images[step]).float(), labels[step]).backward()
        optimizer.step()
    return [p.detach().float().flatten() for p in model.parameters()]
