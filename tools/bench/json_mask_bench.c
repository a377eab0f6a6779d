/* json_mask_bench.c - what JSON mode's vocabulary mask costs per sampled
 * token (sched/guide.c), on the default model's 49,152-token vocabulary:
 * 100 masks per state, after the first (cached) one.
 *   make && cc -O2 -std=c11 -D_GNU_SOURCE -I. tools/bench/json_mask_bench.c build/libsluice.a \
 *      -o build/json_mask_bench -lpcre2-8 -levent -levent_pthreads -lsqlite3 -lm -fopenmp -pthread
 *   build/json_mask_bench */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "model/model.h"
#include "sched/sched.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){char err[256];struct model_load_opts lo={0};model *m=model_load("models/SmolLM2-135M-Instruct.Q4_1.gguf",&lo,err,sizeof err);
const model_tok *tok=model_get_tok(m);int V=model_tok_n_vocab(tok);uint8_t *a=malloc(V);struct sched_guide_vocab *gv=sched_guide_vocab_create(tok);
const char *states[]={"", "{\"a\":\"some text", "{\"a\":1", "{\"a\":"};
for(int k=0;k<4;k++){struct sched_guide g;sched_guide_init(&g);for(const char*p=states[k];*p;p++)sched_guide_step(&g,*p);
double t0=now();int n=0;for(int r=0;r<100;r++){sched_guide_mask(&g,gv,NULL,0,a);}double dt=(now()-t0)/100;
for(int i=0;i<V;i++)n+=a[i];printf("state '%s': %.3f ms per mask, %d of %d allowed\n",states[k],dt*1e3,n,V);}
return 0;}
