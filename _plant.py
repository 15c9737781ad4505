import torch, time, workbench as wb, sys
from workbench import analysis as an
sys.path.insert(0,'tests')
from factories import tiny
torch.manual_seed(0)
m=wb.HookedDecoder(tiny(positional="rope", d_vocab=200, n_ctx=32)).eval()
g=torch.Generator().manual_seed(1)
p=torch.randn(32,generator=g); p/=p.norm()
cls=set(range(0,200,2))
with torch.no_grad(): m.embed.W_E[list(cls)] += 0.2*p
toks=torch.randint(0,200,(64,12),generator=g)
t=time.time()
probe=an.train_probe(m,toks,lambda s: int(s) in cls, hooks="every resid_pre")
print(time.time()-t)
print(probe.results.to_string())
for l in range(2):
    d=probe.direction(layer=l); print(l, float(d.vector@p))
probe=an.train_probe(m,toks,lambda s: int(s) in cls, hooks="every resid_pre", control="type")
print(probe.results.to_string())
