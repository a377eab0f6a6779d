/* crew.c - the rank threads of tensor parallelism and how a failure of
 * one reaches all.
 *
 * Threads: forward() runs rank 0 on the caller's thread and ranks 1..N-1 on
 * their own threads (the crew), all executing the same plan; the caller
 * returns when every rank's stream is done. A rank that fails (CUDA, cuBLAS
 * or NCCL error) raises a flag; every rank waiting on its stream polls the
 * flag and its communicator's async error, aborts its communicator (which
 * ends collectives stuck waiting for the failed rank) and returns, so a
 * failure never hangs: forward() returns SL_EDEVICE and sets base.fatal.
 * The failing rank also sets the peer all-reduce's abort flag (pinned host
 * memory every GPU reads), which ends its kernels' waits.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/kda.h"
#include "cuda/mtp.h"

/* Waits for rank k's stream. With N > 1 it polls, so that a failure of
 * another rank (the flag) or of this rank's communicator (its async error)
 * aborts the communicator instead of waiting forever in a collective. */
int cuda_rank_wait(struct rank *k, char *err, size_t errlen)
{
    struct cuda_backend *b = k->b;
    if (b->tp == 1) {
        CK(cudaStreamSynchronize(k->st));
        return 0;
    }
    for (unsigned spin = 0;; spin++) {
        cudaError_t e = cudaStreamQuery(k->st);
        if (e == cudaSuccess) return 0;
        if (e != cudaErrorNotReady) {
            sl_seterr(err, errlen, "GPU %d: %s", k->dev, cudaGetErrorString(e));
            return SL_EDEVICE;
        }
        ncclResult_t ar = ncclSuccess;
        if (k->comm && ncclCommGetAsyncError(k->comm, &ar) == ncclSuccess && ar != ncclSuccess &&
            ar != ncclInProgress) {
            sl_seterr(err, errlen, "GPU %d: NCCL: %s", k->dev, ncclGetErrorString(ar));
            return SL_EDEVICE;
        }
        if (atomic_load(&b->failed)) {
            sl_seterr(err, errlen, "GPU %d: stopped because another rank failed", k->dev);
            return SL_EDEVICE;
        }
        if (spin > 64) sched_yield();
    }
fail:
    return SL_EDEVICE;
}

static void *abort_comm(void *comm)
{
    ncclCommAbort((ncclComm_t)comm);
    return NULL;
}

/* Runs job on rank k (its device is made current). */
static int run_job(struct rank *k, enum job job)
{
    char *err = k->err;
    size_t errlen = sizeof k->err;
    int rc = 0;
    err[0] = 0;
    switch (job) {
    case JOB_INIT: rc = cuda_rank_init(k, err, errlen); break;
    case JOB_KV: rc = cuda_rank_kv_alloc(k, err, errlen); break;
    case JOB_FORWARD: rc = cuda_rank_forward(k, err, errlen); break;
    case JOB_KDA_ROLLBACK: rc = cuda_kda_rank_rollback(k, err, errlen); break;
    case JOB_MTP_DRAFT: rc = cuda_mtp_rank_draft(k, err, errlen); break;
    case JOB_EXIT: break;
    }
    if (rc && k->b->tp > 1) {
        atomic_store(&k->b->failed, 1);
        if (k->b->peer_abort) *(volatile int *)k->b->peer_abort = 1; /* ends the peer all-reduce's waits */
        fprintf(stderr, "cuda: GPU %d failed (%s); aborting its NCCL communicator\n", k->dev, err);
        /* ends this rank's collectives; peers stuck in theirs see the flag.
         * On its own thread: an abort that waits on a wedged GPU must not
         * hold up the error reaching the engine */
        pthread_t th;
        if (k->comm && pthread_create(&th, NULL, abort_comm, k->comm) == 0) pthread_detach(th);
        k->comm = NULL;
    }
    return rc;
}

/* ---- the crew ------------------------------------------------------------------ */

static void *rank_main(void *arg)
{
    struct rank *k = arg;
    struct cuda_backend *b = k->b;
    unsigned seen = 0;
    for (;;) {
        /* spin a little first: decode steps follow each other within milliseconds */
        for (int i = 0; i < 20000 && atomic_load(&b->gen) == seen; i++)
            if (i > 200) sched_yield();
        pthread_mutex_lock(&b->mu);
        while (atomic_load(&b->gen) == seen) pthread_cond_wait(&b->go, &b->mu);
        seen = atomic_load(&b->gen);
        enum job job = b->cur;
        pthread_mutex_unlock(&b->mu);
        if (job == JOB_EXIT) return NULL;
        k->rc = run_job(k, job);
        if (atomic_fetch_sub(&b->left, 1) == 1) {
            pthread_mutex_lock(&b->mu);
            pthread_cond_broadcast(&b->done);
            pthread_mutex_unlock(&b->mu);
        }
    }
}

static int crew_start(struct cuda_backend *b, char *err, size_t errlen)
{
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->go, NULL);
    pthread_cond_init(&b->done, NULL);
    b->crew = true;
    for (int i = 1; i < b->tp; i++) {
        if (pthread_create(&b->r[i].th, NULL, rank_main, &b->r[i])) {
            sl_seterr(err, errlen, "cannot start the thread of GPU %d", i);
            return SL_ENOMEM;
        }
        b->r[i].th_started = true;
    }
    return 0;
}

/* Runs job on every rank: rank 0 here, the others on their threads; returns
 * the first failing rank's error (by rank order). */
int cuda_crew_run(struct cuda_backend *b, enum job job, char *err, size_t errlen)
{
    if (b->tp > 1 && !b->crew && crew_start(b, err, errlen)) return SL_ENOMEM;
    if (b->tp > 1) {
        pthread_mutex_lock(&b->mu);
        b->cur = job;
        atomic_store(&b->left, b->tp - 1);
        atomic_fetch_add(&b->gen, 1);
        pthread_cond_broadcast(&b->go);
        pthread_mutex_unlock(&b->mu);
    }
    b->r[0].rc = run_job(&b->r[0], job);
    if (b->tp > 1) {
        for (int i = 0; i < 20000 && atomic_load(&b->left) > 0; i++)
            if (i > 200) sched_yield();
        pthread_mutex_lock(&b->mu);
        while (atomic_load(&b->left) > 0) pthread_cond_wait(&b->done, &b->mu);
        pthread_mutex_unlock(&b->mu);
    }
    /* the first rank that failed for itself, not one that stopped for a peer */
    int first = -1;
    for (int i = 0; i < b->tp; i++)
        if (b->r[i].rc && (first < 0 || (strstr(b->r[first].err, "another rank") && !strstr(b->r[i].err, "another rank"))))
            first = i;
    if (first < 0) return 0;
    if (b->tp > 1)
        sl_seterr(err, errlen, "tensor-parallel rank %d: %s", first, b->r[first].err);
    else
        sl_seterr(err, errlen, "%s", b->r[first].err);
    return b->r[first].rc;
}
