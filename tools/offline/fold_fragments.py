#!/usr/bin/env python3
# Emulates, with NumPy, the fragments of rpipe_commit (kernels/kda_ring_delta.cu in the experiment
# commit that adds this file): the commit fold S' = diag(P) S + E^T U as mma.m16n8k8 tiles over rows
# 16 apart, the record rows at fold_row(r), entries past `pend` never read; checks the committed
# tile and the two products against a direct computation (PTX fragment layouts as in
# kernels/kda_ring_mma.cu). Run: python3 tools/offline/fold_fragments.py
import numpy as np
rng=np.random.default_rng(1)
K=V=128; RL=8
for pend in [1,3,8]:
    S=rng.standard_normal((K,V)); P=rng.random(K); E=rng.standard_normal((RL,K)); U=rng.standard_normal((RL,V))
    pk=rng.standard_normal(K); pq=rng.standard_normal(K)
    E[pend:]=np.nan; U[pend:]=np.nan  # stale data must never be read unguarded
    fold_row=lambda r: (r&15)*8+(r>>4)
    sa=RL+ (12-RL%8)%8
    # record as the prep writes it
    pm=np.zeros(K); pkf=np.zeros(K); pqf=np.zeros(K); ek=np.full(K*sa, np.nan)
    for r in range(K):
        pm[fold_row(r)]=P[r]; pkf[fold_row(r)]=pk[r]; pqf[fold_row(r)]=pq[r]
        for j in range(RL): ek[fold_row(r)*sa+j]=E[j,r]
    ua=U.reshape(-1)
    Snew=S.copy(); AK=np.zeros(V); AQ=np.zeros(V)
    for warp in range(8):
        n0=warp*16
        ak=np.zeros((32,4)); aq=np.zeros((32,4))
        def Bfrag(lane, ni, j0):
            g,t=lane>>2,lane&3; col=n0+8*ni+g; ja=j0+t; jb=ja+4
            return (ua[ja*V+col] if ja<pend else 0.0, ua[jb*V+col] if jb<pend else 0.0)
        for i in range(8):
            # per lane accumulators
            C=np.zeros((32,2,4)); rows={}
            for lane in range(32):
                g,t=lane>>2,lane&3; r0=16*g+i; r1=r0+8; q0=8*i+g; q1=8*(8+i)+g
                assert fold_row(r0)==q0 and fold_row(r1)==q1
                rows[lane]=(r0,r1,q0,q1)
                for ni in range(2):
                    col=n0+8*ni+2*t
                    C[lane,ni]=[pm[q0]*S[r0,col],pm[q0]*S[r0,col+1],pm[q1]*S[r1,col],pm[q1]*S[r1,col+1]]
            for j0 in range(0,pend,8):
                A={}
                for lane in range(32):
                    g,t=lane>>2,lane&3; r0,r1,q0,q1=rows[lane]; ja=j0+t; jb=ja+4
                    A[lane]=[ek[q0*sa+ja] if ja<pend else 0.0, ek[q1*sa+ja] if ja<pend else 0.0,
                             ek[q0*sa+jb] if jb<pend else 0.0, ek[q1*sa+jb] if jb<pend else 0.0]
                for ni in range(2):
                    # emulate mma.m16n8k8: Am[m][k], Bm[k][n] from fragments
                    Am=np.zeros((16,8)); Bm=np.zeros((8,8))
                    for lane in range(32):
                        g,t=lane>>2,lane&3; a=A[lane]
                        Am[g,t]=a[0]; Am[g+8,t]=a[1]; Am[g,t+4]=a[2]; Am[g+8,t+4]=a[3]
                        b0,b1=Bfrag(lane,ni,j0); Bm[t,g]=b0; Bm[t+4,g]=b1
                    D=Am@Bm
                    for lane in range(32):
                        g,t=lane>>2,lane&3
                        C[lane,ni]+= [D[g,2*t],D[g,2*t+1],D[g+8,2*t],D[g+8,2*t+1]]
            for lane in range(32):
                g,t=lane>>2,lane&3; r0,r1,q0,q1=rows[lane]
                for ni in range(2):
                    col=n0+8*ni+2*t
                    Snew[r0,col],Snew[r0,col+1],Snew[r1,col],Snew[r1,col+1]=C[lane,ni]
                    for e in range(2):
                        ak[lane,2*ni+e]+=pkf[q0]*C[lane,ni,e]+pkf[q1]*C[lane,ni,2+e]
                        aq[lane,2*ni+e]+=pqf[q0]*C[lane,ni,e]+pqf[q1]*C[lane,ni,2+e]
        # reduce over g
        for lane in range(4):
            t=lane
            for ni in range(2):
                for e in range(2):
                    col=n0+8*ni+2*t+e
                    AK[col]=sum(ak[t+4*g,2*ni+e] for g in range(8)); AQ[col]=sum(aq[t+4*g,2*ni+e] for g in range(8))
    Eg=np.nan_to_num(E[:pend]); Ug=U[:pend]
    Sref=P[:,None]*S+Eg.T@Ug
    print(pend, np.abs(Snew-Sref).max(), np.abs(AK-pk@Sref).max(), np.abs(AQ-pq@Sref).max())
