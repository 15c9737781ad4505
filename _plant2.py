import torch, workbench as wb, sys
from workbench import analysis as an
sys.path.insert(0,'tests')
from factories import tiny
for alpha in [0.05,0.1,0.2,0.5]:
  for l2 in [1e-3,1e-2,1e-1]:
    m=wb.HookedDecoder(tiny(positional="rope", d_vocab=200, n_ctx=32)).eval()
    g=torch.Generator().manual_seed(1)
    p=torch.randn(32,generator=g); p/=p.norm()
    cls=set(range(0,200,2))
    with torch.no_grad(): m.embed.W_E[list(cls)] += alpha*p
    toks=torch.randint(0,200,(64,12),generator=g)
    probe=an.train_probe(m,toks,lambda s: int(s) in cls, hooks=["blocks.0.hook_resid_pre","blocks.1.hook_resid_post"], l2=l2, n_boot=20)
    r=probe.results
    print(alpha,l2, [round(float(probe.direction(layer=l).vector@p),3) for l in (0,1)], r.acc.round(3).tolist(), r.control_auc.round(2).tolist())
