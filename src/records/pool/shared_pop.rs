//! One pop per pool for a batch of requests, shared out in arrival order.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use super::{PoolKeys, Popped, RedisFailure};

/// Groups `requests` by the pool `pool_of` names, pops each pool once (with
/// `pop`, given the group's first request and the group's total `count_of`)
/// and gives each request its share, in the order the requests came. A
/// failed pop fails every request of its pool alike.
pub async fn pop_shared<T, Fut>(
    requests: Vec<T>,
    pool_of: impl Fn(&T) -> &Arc<PoolKeys>,
    count_of: impl Fn(&T) -> usize,
    pop: impl Fn(&T, usize) -> Fut,
) -> Vec<(T, Result<Popped, RedisFailure>)>
where
    Fut: Future<Output = Result<Popped, RedisFailure>>,
{
    let mut groups: HashMap<Arc<PoolKeys>, Vec<T>> = HashMap::new();
    for request in requests {
        groups
            .entry(pool_of(&request).clone())
            .or_default()
            .push(request);
    }
    let pops = groups.into_values().map(|group| {
        let total: usize = group.iter().map(&count_of).sum();
        let popped = pop(&group[0], total);
        async move { (group, popped.await) }
    });
    let mut shared = Vec::new();
    for (group, popped) in futures::future::join_all(pops).await {
        match popped {
            Ok(popped) => {
                let mut seqs = popped.seqs.into_iter();
                for request in group {
                    let share = Popped {
                        seqs: seqs.by_ref().take(count_of(&request)).collect(),
                        depth: popped.depth,
                        target: popped.target,
                    };
                    shared.push((request, Ok(share)));
                }
            }
            Err(e) => shared.extend(group.into_iter().map(|request| (request, Err(e.clone())))),
        }
    }
    shared
}
